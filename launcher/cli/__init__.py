"""The ``mtrain`` command line: parsing, validation into a frozen config, and the small commands.

    module            what it does
    main              the click commands and the user-facing errors (the console script's ``entry``)
    run_options       ``mtrain run``'s options as one frozen value, before validation
    config            the frozen, validated ``LaunchConfig`` of one ``mtrain run``
    tuning            Horovod's tuning flags and ``--config-file``, as settings for the ranks
    capabilities      ``mtrain check``: what this install can do
    timeline_summary  ``mtrain timeline-summary``
    module_files      load a module from its file under a name of our choosing
"""
