"""`counterpoint grader ...` (placeholder; the grader service fills this in)."""

import typer

app = typer.Typer(no_args_is_help=True)
