"""The `counterpoint` command. Each package owns its sub-commands; heavy imports stay inside
the commands so that `--help` is instant."""

from __future__ import annotations

import typer

from config.runtime_env import apply_defaults

apply_defaults()

app = typer.Typer(
    name="counterpoint",
    help="LoRA GRPO against programmatic verifiers, distributed on Ray.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    rich_markup_mode=None,  # help texts name config keys as [eval.seed]: text, not Rich markup
)


def _register() -> None:
    from graders.cli import app as grader_app
    from rollout.cli import app as rollout_app
    from services.logprobs import logprobs

    # `rollout logprobs` runs the learner's log-prob pass: it lives above both packages.
    rollout_app.command()(logprobs)
    app.add_typer(grader_app, name="grader", help="Verifiers: serve over gRPC, score JSONL.")
    app.add_typer(rollout_app, name="rollout", help="Generation engines and the Serve deployment.")
    from services import commands

    commands.register(app)


_register()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
