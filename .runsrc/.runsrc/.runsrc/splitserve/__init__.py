"""The `splitserve` command: subcommands import their package only when chosen."""
