"""One module per `helix` subcommand: each exposes add_parser(subparsers) and run(args) -> int."""
