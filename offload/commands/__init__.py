"""The ``offload`` command line and the jobs it runs: ``train``, ``demo``, ``estimate``, and the argument types
that check values where they are parsed."""
