"""What every subcommand's parser shares."""


def overrides_help() -> str:
    return "section.key=value overrides, applied after the file (CLI > file > defaults)"
