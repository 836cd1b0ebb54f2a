"""LoRA adapters on the HTTP side: adapters are model names.

- A request's `model` is the served model (the base) or a loaded adapter's name; an adapter the
  caller's tenant may not use answers exactly like one that does not exist (404
  model_not_found), so tenants cannot probe each other's adapters.
- `/v1/models` lists the base model and the adapters the caller may use, each with
  `parent` = the base model (vLLM's shape).
- `POST /v1/load_lora_adapter` {lora_name, lora_path} and `POST /v1/unload_lora_adapter`
  {lora_name} (vLLM's shapes) change the loaded set between engine steps; only with
  --allow-runtime-lora and only for admin keys. A name is letters, digits and `._:-` (no path
  pieces); a path must be a directory holding adapter_config.json, under --lora-root when set,
  and every path that is not gets the same answer (no probing which part of it exists).
"""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

from fastapi import Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel

from pagoda.engine.client import EngineDeadError
from pagoda.errors import InvalidRequest
from pagoda.lora_request import LoRARequest
from pagoda.serve.admission.tenants import Tenant
from pagoda.serve.api.protocol import ModelCard
from pagoda.serve.errors import APIError, bad_request, engine_unavailable, invalid_request, model_not_found
from pagoda.serve.serving import ServeContext

# What an adapter name may be: it is a model name in requests and /v1/models, never a path.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
MAX_PATH_CHARS = 4096  # PATH_MAX


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None  # accepted for vLLM clients; the name decides


def resolve_model(ctx: ServeContext, model: str | None, tenant: Tenant) -> LoRARequest | None:
    """The adapter a request's `model` names (None: the base model); 404 for anything else."""
    if model is None or ctx.answers_to(model):
        return None
    if model in ctx.llm.lora_names and ctx.settings.tenants.may_use_adapter(tenant, model):
        return LoRARequest(model)
    raise model_not_found(model)


def adapter_cards(ctx: ServeContext, tenant: Tenant, created: int) -> list[ModelCard]:
    return [
        ModelCard(id=name, created=created, root=name, parent=ctx.model_name, max_model_len=ctx.llm.max_model_len)
        for name in sorted(ctx.llm.lora_names)
        if ctx.settings.tenants.may_use_adapter(tenant, name)
    ]


def _check_allowed(ctx: ServeContext, tenant: Tenant) -> None:
    if not ctx.settings.allow_runtime_lora:
        raise APIError(
            404,
            "Loading and unloading LoRA adapters at run time is off; start the server with --allow-runtime-lora.",
            type="not_found_error",
            code="runtime_lora_disabled",
        )
    if not tenant.admin:
        raise APIError(
            403, "Only admin keys may load or unload LoRA adapters.", type="permission_error", code="admin_required"
        )


async def load_lora_adapter(ctx: ServeContext, _: Request, body: LoadLoRAAdapterRequest, tenant: Tenant) -> Response:
    _check_allowed(ctx, tenant)
    name = body.lora_name.strip()
    if not name or not body.lora_path.strip():
        raise bad_request("Both lora_name and lora_path must be non-empty.", param="lora_name")
    if not ADAPTER_NAME.fullmatch(name) or ".." in name:
        raise bad_request(
            "lora_name must be 1 to 128 letters, digits and ._:- (starting with a letter or digit, no '..').",
            param="lora_name",
        )
    path = await asyncio.to_thread(usable_adapter_dir, name, body.lora_path, ctx.settings.lora_root)
    if name == ctx.model_name:
        raise bad_request(
            f"The LoRA adapter name {name!r} is the served model's name.", param="lora_name", code="lora_adapter_exists"
        )
    try:
        await ctx.llm.add_lora(LoRARequest(name, 0, path))
    except InvalidRequest as error:
        raise invalid_request(error) from None
    except EngineDeadError:
        raise engine_unavailable() from None
    # The engine read the files it needs: hash them for the requests' provenance.
    await asyncio.to_thread(ctx.provenance.adapter_loaded, name, path)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


def usable_adapter_dir(name: str, lora_path: str, lora_root: str | None) -> str:
    """`lora_path` resolved, when it is a directory holding adapter_config.json (under
    `lora_root` when given); else the one 400 every unusable path gets."""
    unusable = bad_request(
        f"lora_path for {name!r} is not a usable LoRA adapter: a readable directory holding "
        f"adapter_config.json{' under the server' + chr(39) + 's --lora-root' if lora_root else ''}.",
        param="lora_path",
        code="lora_path_unusable",
    )
    if len(lora_path) > MAX_PATH_CHARS or "\0" in lora_path:
        raise unusable
    try:
        resolved = Path(lora_path).expanduser().resolve(strict=True)
        if lora_root is not None:
            root = Path(lora_root).resolve(strict=True)
            if resolved != root and root not in resolved.parents:
                raise unusable
        if not (
            resolved.is_dir()
            and (resolved / "adapter_config.json").is_file()
            and os.access(resolved / "adapter_config.json", os.R_OK)
        ):
            raise unusable
    except (OSError, RuntimeError, ValueError):  # too long, a loop of links, unreadable
        raise unusable from None
    return str(resolved)


async def unload_lora_adapter(
    ctx: ServeContext, _: Request, body: UnloadLoRAAdapterRequest, tenant: Tenant
) -> Response:
    _check_allowed(ctx, tenant)
    try:
        await ctx.llm.remove_lora(body.lora_name)
    except InvalidRequest as error:
        raise invalid_request(error) from None
    except EngineDeadError:
        raise engine_unavailable() from None
    ctx.provenance.adapter_unloaded(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
