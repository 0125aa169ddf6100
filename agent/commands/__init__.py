"""CLI subcommands: each module has ``add_parser(subparsers)`` and sets ``func`` to its runner."""
