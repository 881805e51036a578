"""The ground layer: what every other part of the package uses, importing none of them.

``errors`` (the exceptions and their exit codes), ``console`` (the package's logger), ``checks``
(the checks' one convention, the rules of single values, the bounds several parts share),
``records`` (a prompt record's fields), ``context`` (``RunContext``: one run's shared state) with
``preemption`` (stopping at a batch boundary), ``interrupt`` (Ctrl-C while the command starts),
``groups`` (a config section as its group's options) and ``system`` (a process's liveness, a file's
SHA-256, the command's start).

Nothing is imported here: ``interrupt`` is the package's first import.
"""
