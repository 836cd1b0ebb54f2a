"""Flags generated from the settings dataclasses: each setting is declared once, its choices come
from its Literal type, and a command takes only the settings it uses."""

from __future__ import annotations

import argparse
import dataclasses
from typing import get_args

import pytest

from pagoda.cli import build_parser
from pagoda.config import DeploymentConfig, EngineConfig, RouterName, ToolCallParserName
from pagoda.replicas.policies import POLICIES
from pagoda.serve.api.tool_calls import PARSER_CLASSES
from pagoda.serve.settings import ServerSettings


def flag_dests(argv: list[str]) -> set[str]:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command = subparsers.choices[argv[0]]
    for name in argv[1:]:
        inner = next(a for a in command._actions if isinstance(a, argparse._SubParsersAction))
        command = inner.choices[name]
    return {action.dest for action in command._actions}


def test_registries_are_keyed_by_the_literal_names() -> None:
    assert tuple(POLICIES) == get_args(RouterName)
    assert tuple(PARSER_CLASSES) == get_args(ToolCallParserName)


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--prompt", "x", "--router", "round_robin"],
        ["chat", "--data-parallel-size", "2"],
        ["eval", "perplexity", "--text", "t", "--replica-roles", "prefill=1,decode=1"],
        ["bench", "offline", "--route-rules", "rules.yaml"],
    ],
)
def test_offline_commands_refuse_deployment_flags(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_each_command_has_the_flags_of_what_it_runs() -> None:
    engine = {f.name for f in dataclasses.fields(EngineConfig) if "help" in f.metadata}
    deployment = {f.name for f in dataclasses.fields(DeploymentConfig)}
    server = {f.name for f in dataclasses.fields(ServerSettings) if "help" in f.metadata}
    serve = flag_dests(["serve"])
    assert engine | deployment | server <= serve
    for argv in (["generate"], ["chat"], ["eval", "perplexity"], ["bench", "offline"]):
        dests = flag_dests(argv)
        assert not dests & (deployment | server), argv
        assert engine - {"seed"} <= dests, argv


def test_choices_come_from_the_literal_types(capsys) -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--router",
            "least_load",
            "--tool-call-parser",
            "mistral",
            "--quantization-group-size",
            "64",
            "--no-log-prompts",
        ]
    )
    assert DeploymentConfig.from_cli_args(args).router == "least_load"
    assert ServerSettings.from_cli_args(args).tool_call_parser == "mistral"
    assert EngineConfig.from_cli_args(args).quantization_group_size == 64
    for argv in (
        ["--router", "random"],
        ["--preemption-mode", "never"],
        ["--attention-backend", "cuda"],
        ["--metrics-compat", "sglang"],
        ["--engine-transport", "ray"],
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *argv])
        assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(ValueError, match="preemption_mode must be recompute, swap or auto, got 'never'"):
        EngineConfig(preemption_mode="never")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match="tool_call_parser must be hermes, llama3_json, mistral, qwen3_coder, pythonic or deepseek_v3"
    ):
        ServerSettings(tool_call_parser="xml")  # type: ignore[arg-type]


def test_the_offline_llm_refuses_deployment_settings() -> None:
    from pagoda.engine.llm import LLM

    with pytest.raises(ValueError, match="data_parallel_size: deployment settings"):
        LLM(data_parallel_size=2)
    with pytest.raises(ValueError, match="replica_roles, router"):
        LLM(router="round_robin", replica_roles="prefill=1,decode=1")


def test_roles_come_from_the_deployment() -> None:
    deployment = DeploymentConfig(replica_roles="prefill=1,decode=2")
    engine = EngineConfig(seed=5)
    replicas = [deployment.replica_config(engine, index) for index in range(deployment.num_replicas)]
    assert [(r.role, r.seed, r.num_replicas) for r in replicas] == [
        ("prefill", 5, 3),
        ("decode", 6, 3),
        ("decode", 7, 3),
    ]
    with pytest.raises(ValueError, match="draft is not supported with role"):
        deployment.validate_with(EngineConfig(speculative="draft", draft_model=engine.model))


def test_each_replica_has_its_own_disk_tier_directory() -> None:
    engine = EngineConfig(kv_offload_memory="1MiB", kv_offload_disk="/srv/kv")
    replicas = [DeploymentConfig(data_parallel_size=2).replica_config(engine, i) for i in range(2)]
    assert [r.kv_offload_disk for r in replicas] == ["/srv/kv/replica-0", "/srv/kv/replica-1"]
    assert DeploymentConfig().replica_config(engine, 0).kv_offload_disk == "/srv/kv"


def test_max_num_seqs_bound() -> None:
    assert EngineConfig(max_num_seqs=7).max_num_seqs_bound == 7
    assert EngineConfig().max_num_seqs_bound == 256
