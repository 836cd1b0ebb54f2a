"""The engine's commands: what the admin routes (serve/admin.py) ask of a running engine, by
name with JSON-able arguments, applied between steps on the engine's thread
(LLMEngine.run_command) and answered like an add (accepted, or refused with the reason).

    update_weights_from_disk {model_path}     stage and commit a safetensors directory
    stage_weights_from_disk {model_path}      stage only (a replica set, before committing on all)
    init_weight_update_group {master_address, master_port, rank_offset, world_size, backend, timeout_s, rank}
    start_weight_update {}                    vLLM's phases: start, update, finish
    update_weights {names, dtypes, shapes, snapshot?}  receive the trainer's broadcasts and stage
                                              them (saved as a safetensors directory at snapshot)
    finish_weight_update {abort}              commit what is staged (or drop it)
    destroy_weight_update_group {}
    pause {mode} / resume {}                  keep, wait or abort what is in flight
    sleep {level} / wake_up {}
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from pagoda.engine.sleep_mode import SleepMode
from pagoda.engine.weight_updates import WeightUpdates
from pagoda.errors import InvalidRequest
from pagoda.rl.weight_group import WeightGroupSpec, parse_metas


class LLMEngine(Protocol):
    """What the commands act on (pagoda.engine.llm_engine.LLMEngine, which imports this module)."""

    weight_updates: WeightUpdates
    sleep_mode: SleepMode

    def pause(self, mode: str) -> bool: ...

    def resume(self) -> None: ...


def _from_disk(engine: LLMEngine, args: dict[str, Any]) -> bool:
    _stage_from_disk(engine, args)
    engine.weight_updates.commit()
    return True


def _stage_from_disk(engine: LLMEngine, args: dict[str, Any]) -> bool:
    _awake(engine)
    engine.weight_updates.stage_from_disk(_text(args, "model_path"))
    return True


def _init_group(engine: LLMEngine, args: dict[str, Any]) -> bool:
    try:
        spec = WeightGroupSpec(
            str(args["master_address"]),
            int(args["master_port"]),
            int(args["rank_offset"]),
            int(args["world_size"]),
            str(args.get("backend", "gloo")),
            float(args.get("timeout_s", 120.0)),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise InvalidRequest(f"init_weight_update_group: {error}") from None
    engine.weight_updates.join_group(spec, int(args.get("rank", spec.rank_offset)))
    return True


def _start(engine: LLMEngine, _: dict[str, Any]) -> bool:
    _awake(engine)
    engine.weight_updates.start()
    return True


def _update(engine: LLMEngine, args: dict[str, Any]) -> bool:
    try:
        metas = parse_metas(list(args["names"]), list(args["dtypes"]), [list(s) for s in args["shapes"]])
    except (KeyError, TypeError, ValueError) as error:
        raise InvalidRequest(f"update_weights: {error}") from None
    snapshot = args.get("snapshot")
    engine.weight_updates.stage_received(metas, _text(args, "snapshot") if snapshot is not None else None)
    return True


def _finish(engine: LLMEngine, args: dict[str, Any]) -> bool:
    if args.get("abort"):
        engine.weight_updates.discard()
    else:
        engine.weight_updates.commit()
    return True


def _destroy(engine: LLMEngine, _: dict[str, Any]) -> bool:
    engine.weight_updates.destroy_group()
    return True


def _pause(engine: LLMEngine, args: dict[str, Any]) -> bool:
    return engine.pause(str(args.get("mode", "wait")))


def _resume(engine: LLMEngine, _: dict[str, Any]) -> bool:
    engine.resume()
    return True


def _sleep(engine: LLMEngine, args: dict[str, Any]) -> bool:
    try:
        level = int(args.get("level", 1))
    except (TypeError, ValueError):
        raise InvalidRequest(f"level must be 1 or 2, got {args.get('level')!r}") from None
    engine.sleep_mode.sleep(level)
    return True


def _wake_up(engine: LLMEngine, _: dict[str, Any]) -> bool:
    engine.sleep_mode.wake_up()
    return True


def _awake(engine: LLMEngine) -> None:
    if engine.sleep_mode.level:
        raise InvalidRequest("the engine is asleep: wake it up first")


def _text(args: dict[str, Any], key: str) -> str:
    value = args.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{key} must be a non-empty string")
    return value


COMMANDS: dict[str, Callable[[LLMEngine, dict[str, Any]], bool]] = {
    "update_weights_from_disk": _from_disk,
    "stage_weights_from_disk": _stage_from_disk,
    "init_weight_update_group": _init_group,
    "start_weight_update": _start,
    "update_weights": _update,
    "finish_weight_update": _finish,
    "destroy_weight_update_group": _destroy,
    "pause": _pause,
    "resume": _resume,
    "sleep": _sleep,
    "wake_up": _wake_up,
}


def run_command(engine: LLMEngine, command: str, args: dict[str, Any]) -> bool:
    """Apply `command`; True when answered now (pause(wait) answers once drained). Raises
    InvalidRequest with the reason it was refused."""
    apply = COMMANDS.get(command)
    if apply is None:
        raise InvalidRequest(f"unknown engine command {command!r}")
    return apply(engine, args)
