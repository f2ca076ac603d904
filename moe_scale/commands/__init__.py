"""One module per `moe-scale` subcommand: `add_parser(subparsers)` and `run(args)`."""
