"""The ``d9d`` command's subcommands (private: the command line is the interface)."""
