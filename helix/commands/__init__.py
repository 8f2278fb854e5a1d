"""Subcommands of the `helix` CLI: each module exposes add_parser(subparsers), registering its
command with set_defaults(func=run), and run(args) -> int."""
