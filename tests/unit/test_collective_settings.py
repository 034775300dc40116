"""The collectives' variables are rows of the runtime's settings table: the launcher refuses a bad
value before the job starts, with the text every rank's init() would raise (no MPI)."""
from __future__ import annotations

import pytest

from mtrain.launcher.cli import tuning

REFUSED = {
    "MTRAIN_ALLREDUCE_ALGORITHM": (" NCCL", "MTRAIN_ALLREDUCE_ALGORITHM=' NCCL' is not an all-reduce algorithm; set it "
                                            "to one of auto, ring, shm, hierarchical, mpi (or unset it for auto)"),
    "MTRAIN_SHM_TRANSPORT": ("xpmem", "MTRAIN_SHM_TRANSPORT='xpmem' is not a shared-memory transport; set it to one "
                                      "of auto, cma, segment (or unset it for auto)"),
    "MTRAIN_SHM_STRIPE_BYTES": (" 0 ", "MTRAIN_SHM_STRIPE_BYTES='0' is not a positive number of bytes; set it to one "
                                       "(default 2097152) or unset it"),
    "MTRAIN_CUDA_AWARE": ("Maybe", "MTRAIN_CUDA_AWARE='maybe': use 1 (MPI reads GPU memory), 0 (stage through host "
                                   "memory), or leave it unset to ask MPI"),
    "MTRAIN_RING_SEGMENT_BYTES": ("-1", "MTRAIN_RING_SEGMENT_BYTES='-1' is not a number >= 0; set it to one or unset it"),
    "MTRAIN_SMALL_ALLREDUCE_BYTES": ("lots", "MTRAIN_SMALL_ALLREDUCE_BYTES='lots' is not a number >= 0; set it to one "
                                             "or unset it"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_bad_collectives_variable_is_refused_by_the_launcher(name):
    value, text = REFUSED[name]
    assert tuning.refused_variable({name: value}) == text


def test_good_collectives_variables_pass():
    good = {"MTRAIN_ALLREDUCE_ALGORITHM": "SHM", "MTRAIN_SHM_TRANSPORT": "cma", "MTRAIN_SHM_STRIPE_BYTES": "4096",
            "MTRAIN_CUDA_AWARE": "yes", "MTRAIN_RING_SEGMENT_BYTES": "24", "MTRAIN_SMALL_ALLREDUCE_BYTES": "0"}
    assert tuning.refused_variable(good) is None
