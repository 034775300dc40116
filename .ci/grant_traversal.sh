#!/usr/bin/env bash
# Let local users reach paths (a checkout, an interpreter) through folders closed to them, and
# undo it afterwards.
#
#   grant_traversal.sh grant STATE USER... -- PATH...
#   grant_traversal.sh undo STATE
#
# `grant` walks every folder from / down to each PATH. Where USER cannot already pass through
# a folder (checked as that user), it adds x to USER's ACL entry there, after saving the folder's
# ACL under STATE (a folder of root's, made if missing). It never narrows what a user has: a
# named-user ACL entry takes precedence over the "other" bits, so an entry `u:USER:--x` on /tmp
# (mode 1777) would take away USER's right to create files in it. A folder the user can already
# pass through is left as it is, and so is every world-writable sticky folder (/tmp, /var/tmp).
# `undo` puts back every ACL that `grant` changed, in reverse order, and removes STATE.
set -euo pipefail

usage() {
    echo "usage: $0 grant STATE USER... -- PATH... | $0 undo STATE" >&2
    exit 2
}

can_traverse() {  # USER DIR: USER may pass through DIR (as far as the folders above allow)
    runuser -u "$1" -- test -x "$2"
}

sticky_world_writable() {  # DIR
    local mode
    mode=$(stat -c '%a' "$1")
    [ "${#mode}" -eq 4 ] && [ $(( 8#${mode:0:1} & 1 )) -eq 1 ] && [ $(( 8#${mode: -1} & 2 )) -eq 2 ]
}

grant_one() {  # STATE USER DIR
    local state=$1 user=$2 dir=$3 current saved
    if sticky_world_writable "$dir" || can_traverse "$user" "$dir"; then
        return 0
    fi
    saved="$state/$(printf '%04d' "$(find "$state" -name '*.acl' | wc -l)").acl"
    getfacl --absolute-names "$dir" >"$saved"
    # Keep whatever the user's entry already allows; add x to it.
    current=$(getfacl --absolute-names --omit-header "$dir" | awk -F: -v u="$user" '$1 == "user" && $2 == u {print $3}')
    current=${current:----}
    setfacl -m "u:$user:${current:0:1}${current:1:1}x" "$dir"
}

grant() {
    [ $# -ge 3 ] || usage
    local state=$1 users=() paths=() user path dir parts part
    shift
    while [ $# -gt 0 ] && [ "$1" != -- ]; do users+=("$1"); shift; done
    [ ${#users[@]} -gt 0 ] && [ $# -gt 1 ] || usage
    shift
    paths=("$@")
    mkdir -p -m 0700 "$state"
    for path in "${paths[@]}"; do
        path=$(readlink -f "$path")
        for user in "${users[@]}"; do
            # Top down: a folder is checked once the user can pass through the ones above it.
            dir=
            IFS=/ read -r -a parts <<<"${path#/}"
            for part in "" "${parts[@]}"; do
                dir="${dir%/}/$part"
                [ -d "$dir" ] || break
                grant_one "$state" "$user" "$dir"
            done
        done
    done
}

undo() {
    [ $# -eq 1 ] || usage
    local state=$1 saved failed=0
    [ -d "$state" ] || return 0
    # Newest first; one that cannot be put back (its folder is gone) does not keep the rest.
    while IFS= read -r saved; do
        setfacl --restore="$saved" || failed=1
    done < <(find "$state" -name '*.acl' | sort -r)
    if [ "$failed" -ne 0 ]; then
        echo "$0: some ACLs could not be put back; their saved copies are in $state" >&2
        return 1
    fi
    rm -rf "$state"
}

case ${1:-} in
    grant) shift; grant "$@" ;;
    undo) shift; undo "$@" ;;
    *) usage ;;
esac
