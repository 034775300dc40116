"""The records that cross a process boundary, one module per record and its owner.

Both halves of mtrain import these modules: the runtime inside every rank (``mtrain.ringreduce``)
and the launcher (``mtrain.launcher``).  They depend on the standard library only, because they
run in ranks, SSH agents and remote guards alike.  They live with the launcher, their owner: the
launcher reads what the ranks and agents write (as torchrun's error-file format belongs to
``torch.distributed.elastic.multiprocessing.errors``, which workers import).  Every record is a
``base.Record``: frozen, with one JSON codec driven by its fields' type hints.

    module           record          written by                       read by
    errors           ErrorReport     the runtime, in a rank           the rank wrapper
    exits            ExitRecord      the rank wrapper                 the supervisor
    agent_events     AgentEvent      the SSH agents                   the supervisor
    gate             Gate            the supervisor                   the SSH agents
    job_layout       JobLayout       the launcher (through the gate)  the rank wrapper on every host
    elastic          HostUpdates     the launcher (through the agents) hvd.elastic in the ranks (host-set version)
    elastic          ElasticResume   rank 0 of an elastic generation  the supervisor (the reset's log line)
    phase            PhaseNote       the runtime, in a rank           the supervisor (a job stuck in init())
    steps            StepReport      the runtime's step meter         the straggler report and --progress
    flight_recorder  RecorderDump    the runtime's flight recorder    the supervisor's hang report
    flight_recorder  DumpRequest     the runtime (a stall it coordinates) the supervisor (signals every rank to dump)

Beside them: ``marker`` (records sent as marker lines on a rank's stderr pipe, which the rank
wrapper also hands over as ``$MTRAIN_MARKER_FD``), ``frames`` (the
program's own line a report names) and ``daemon_env`` (the umask and TMPDIR notes that the
launcher passes to Open MPI's daemons and the rank wrapper).

Nothing is imported here: each side imports only the modules it needs, to start fast.
"""
