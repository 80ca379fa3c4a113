"""docs/options.md is what the argument parser gives, and every option says what it does."""

from specpipe.entrypoints import options_reference


def test_options_md_is_the_parsers():
    written = options_reference.OUT.read_text()
    assert written == options_reference.render(), (
        "docs/options.md differs from the parser: run python3 -m specpipe.entrypoints.options_reference")


def test_every_option_has_help_text():
    assert options_reference.undocumented() == []


def test_reference_lists_every_option_of_every_command():
    text = options_reference.render()
    for name, parser in options_reference.commands(options_reference.build_parser()):
        if name != "specpipe":
            assert f"## `{name}`" in text
        for action in options_reference.options(parser):
            for flag in action.option_strings:
                assert f"`{flag}" in text, (name, flag)
