"""`pagoda generate` / `pagoda chat` structured-output flags (parsed as the commands parse them)."""

from __future__ import annotations

import argparse
import json

import pytest

from pagoda.cli.sampling_flags import add_sampling_args, sampling_params_from_args


def parse(*argv: str):
    parser = argparse.ArgumentParser()
    add_sampling_args(parser, default_max_tokens=16)
    return sampling_params_from_args(parser.parse_args(list(argv)), {})


def test_flags_build_the_constraint(tmp_path):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert parse("--json-schema", json.dumps(schema)).structured_outputs.json == schema
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    assert parse("--json-schema", str(path)).structured_outputs.json == schema
    assert parse("--choice", "yes", "--choice", "no").structured_outputs.choice == ["yes", "no"]
    assert parse("--regex", "[0-9]+").structured_outputs.regex == "[0-9]+"
    assert parse("--json-object").structured_outputs.kind == "json_object"
    grammar = tmp_path / "g.gbnf"
    grammar.write_text('root ::= "a" | "b"\n')
    assert parse("--grammar", str(grammar)).structured_outputs.grammar.startswith("root ::=")
    assert parse().structured_outputs is None


@pytest.mark.parametrize(
    "argv, flag",
    [
        (("--regex", "[a-"), "--regex"),
        (("--json-schema", "{not json"), "--json-schema"),
        (("--json-schema", '{"type": "nope"}'), "--json-schema"),
        (("--grammar", "root ::= ("), "--grammar"),
        (("--regex", "a", "--choice", "a"), "exclusive"),
    ],
)
def test_bad_flags_name_the_flag(argv, flag):
    with pytest.raises(ValueError, match=flag):
        parse(*argv)
