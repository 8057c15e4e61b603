"""The YAML config front end: schema, loading, strict validation and degree resolution.

A config is a mapping of optional keys (see :func:`describe_keys`), given as a YAML file,
a dict or an :class:`HSDPConfig`. Validation is strict, because a silently ignored typo
in a sharding config costs a whole training run: unknown keys, wrong types (``1`` for a
bool, ``2.5`` for an int, a bare string for a list), out-of-set values and malformed
module patterns are all errors, collected and reported together in one
:class:`ConfigError`. Nothing here touches a model or a process group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import yaml

from ..hints import did_you_mean
from .patterns import PatternError, parse_pattern

AUTO = "auto"
OUTER_SHARDING = ("none", "optim")  # fsdp_outer_sharding besides 'auto'
DTYPE_ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16",
                 "fp32": "fp32", "float32": "fp32"}
ZERO_STAGES = (1, 2, 3)
DICT_SOURCE = "<dict>"
LOCAL_SIZE_ENV = "PADDLE_LOCAL_SIZE"


class ConfigError(ValueError):
    """One or more config problems; ``errors`` holds them, ``str()`` shows one per line."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


class _Invalid(Exception):
    """Raised by a key check; ``messages`` are '<suffix>: <text>' or '<text>' parts that
    the caller prefixes with the key name."""

    def __init__(self, *messages: str):
        super().__init__(*messages)
        self.messages = messages


# ------------------------------------------------------------------- value checks
def _show(value: Any) -> str:
    """A value as a YAML user wrote it: true/false/null, strings quoted."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return repr(value)


_KIND_NAMES = {bool: "a bool", int: "an int", float: "a float", str: "a string",
               list: "a list", tuple: "a list", dict: "a mapping", type(None): "null"}


def _show_with_kind(value: Any) -> str:
    """A wrongly typed value, with its type, so '1' vs 1 vs true is visible."""
    kind = _KIND_NAMES.get(type(value), type(value).__name__)
    if value is None:
        return "null"
    if isinstance(value, (list, tuple, dict)):
        return kind
    return f"{_show(value)} ({kind})"


def _is_int(value: Any) -> bool:
    # bool is a subclass of int, but 'true' for a size is a mistake, not a 1
    return isinstance(value, int) and not isinstance(value, bool)


def _expected(allowed: str, value: Any, wrong_type: bool) -> _Invalid:
    shown = _show_with_kind(value) if wrong_type else _show(value)
    quoted_bool = isinstance(value, str) and value.lower() in ("true", "false", "yes", "no")
    hint = "; write true or false without quotes" if quoted_bool and "true" in allowed else ""
    return _Invalid(f"expected {allowed}, got {shown}{hint}")


def _check_int_at_least(value: Any, allowed: str, minimum: int):
    if not _is_int(value):
        raise _expected(allowed, value, wrong_type=True)
    if value < minimum:
        raise _expected(allowed, value, wrong_type=False)
    return value


def _check_degree(value: Any, allowed: str):
    return AUTO if value == AUTO else _check_int_at_least(value, allowed, 1)


def _check_bool(value: Any, allowed: str):
    if not isinstance(value, bool):
        raise _expected(allowed, value, wrong_type=True)
    return value


def _check_outer_sharding(value: Any, allowed: str):
    if not isinstance(value, str):
        raise _expected(allowed, value, wrong_type=True)
    if value != AUTO and value not in OUTER_SHARDING:
        raise _expected(allowed, value, wrong_type=False)
    return value


OUTER_COMPRESS = ("int8", "fp8")  # fsdp_outer_compress besides null


def _check_outer_compress(value: Any, allowed: str):
    if value is None:
        return None
    if not isinstance(value, str):
        raise _expected(allowed, value, wrong_type=True)
    if value not in OUTER_COMPRESS:
        raise _expected(allowed, value, wrong_type=False)
    return value


def _check_compress_block(value: Any, allowed: str):
    return _check_int_at_least(value, allowed, 8)


def _check_outer_optimizer(value: Any, allowed: str):
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _expected(allowed, value, wrong_type=True)
    # the policy's own checks (imported here: the schema loads without Paddle)
    from ..engine.policies import outer_sync_policy_from  # noqa: PLC0415
    try:
        outer_sync_policy_from(2, value)
    except (TypeError, ValueError) as error:
        raise _Invalid(str(error)) from None
    return dict(value)


def _check_optional_bool(value: Any, allowed: str):
    return None if value is None else _check_bool(value, allowed)


def _check_zero_stage(value: Any, allowed: str):
    if value is None:
        return None
    if not _is_int(value):
        raise _expected(allowed, value, wrong_type=True)
    if value not in ZERO_STAGES:
        raise _expected(allowed, value, wrong_type=False)
    return value


def _check_dtype(value: Any, allowed: str):
    if value is None:
        return None
    if not isinstance(value, str):
        raise _expected(allowed, value, wrong_type=True)
    if value not in DTYPE_ALIASES:
        raise _expected(allowed, value, wrong_type=False)
    return DTYPE_ALIASES[value]


def _check_non_negative_int(value: Any, allowed: str):
    return _check_int_at_least(value, allowed, 0)


def _check_patterns(value: Any, allowed: str):
    if isinstance(value, str):
        raise _Invalid(f"expected {allowed}, got the string {value!r}; a single pattern "
                       f"must still be a list: [{value!r}]")
    if not isinstance(value, (list, tuple)):
        raise _expected(allowed, value, wrong_type=True)
    problems = []
    for index, text in enumerate(value):
        try:
            parse_pattern(text)
        except PatternError as error:
            problems.append(f"[{index}]: {error}")
    if problems:
        raise _Invalid(*problems)
    return tuple(value)


# -------------------------------------------------------------------------- schema
@dataclass(frozen=True)
class _Key:
    """One config key: its default, the allowed values in words, and its check."""

    name: str
    default: Any
    allowed: str
    check: Callable[[Any, str], Any]

    def validate(self, value: Any) -> Any:
        return self.check(value, self.allowed)


_PATTERN_LIST = "a list of module patterns (path like 'layers.{*}' or class name)"
_DTYPE = "null or one of 'bf16', 'fp16', 'fp32' (or 'bfloat16', 'float16', 'float32')"
_KEYS = (
    _Key("sharding_size", AUTO, "'auto' or an int >= 1 (ranks per shard group)",
         _check_degree),
    _Key("fsdp_outer_degree", AUTO, "'auto' or an int >= 1 (number of replicas)",
         _check_degree),
    _Key("fsdp_outer_sharding", AUTO, "'auto', 'none' or 'optim' (optim: the optimizer "
         "state is sharded across the outer replicas too, HFSDP)", _check_outer_sharding),
    _Key("sub_modules_to_wrap", (), _PATTERN_LIST, _check_patterns),
    _Key("ignored_modules", (), _PATTERN_LIST, _check_patterns),
    _Key("recompute_modules", (), _PATTERN_LIST, _check_patterns),
    _Key("expert_modules", (), _PATTERN_LIST, _check_patterns),
    _Key("use_reentrant", True, "true or false", _check_bool),
    _Key("reshard_after_forward", None, "true, false or null", _check_optional_bool),
    _Key("zero_stage", None, "null or one of 1, 2, 3", _check_zero_stage),
    _Key("cast_forward_inputs", True, "true or false", _check_bool),
    _Key("offload_to_cpu", False, "true or false", _check_bool),
    _Key("pin_memory", False, "true or false", _check_bool),
    _Key("param_dtype", None, _DTYPE, _check_dtype),
    _Key("reduce_dtype", None, _DTYPE, _check_dtype),
    _Key("fsdp_outer_compress", None, "null, 'int8' or 'fp8' (the outer sync crosses "
         "machines as blockwise int8 / float8 e4m3 codes with error feedback)",
         _check_outer_compress),
    _Key("fsdp_outer_compress_block", 256, "an int >= 8 (values per float32 scale of "
         "fsdp_outer_compress)", _check_compress_block),
    _Key("fsdp_outer_sync_every", 1, "an int >= 1 (optimizer steps between outer syncs; "
         "1: plain HSDP, >= 2: DiLoCo, the replicas step apart in between)",
         lambda value, allowed: _check_int_at_least(value, allowed, 1)),
    _Key("fsdp_outer_optimizer", None, "null or a mapping of lr (> 0), momentum (in "
         "[0, 1)) and nesterov (true or false), each optional (DiLoCo's outer SGD; "
         "defaults 0.7, 0.9, true)", _check_outer_optimizer),
    _Key("fsdp_outer_sync_fragments", 1, "an int from 1 to fsdp_outer_sync_every (streaming "
         "DiLoCo: the units synced in that many fragments in turn)",
         lambda value, allowed: _check_int_at_least(value, allowed, 1)),
    _Key("owned_matrices", False, "true or false (true: each matrix Muon updates whole "
         "on one rank, paddle_hsdp.owned_matrices())", _check_bool),
    _Key("output_dtype", None, _DTYPE, _check_dtype),
    _Key("sync_module_states", True, "true or false (true: every rank takes the weights "
         "of its FSDP group's first rank before sharding; false: they are known to be "
         "equal, and are checked)", _check_bool),
    _Key("num_to_forward_prefetch", 1, "an int >= 0", _check_non_negative_int),
    _Key("num_to_backward_prefetch", 1, "an int >= 0", _check_non_negative_int),
)
_KEY_BY_NAME = {key.name: key for key in _KEYS}
VALID_KEYS = tuple(key.name for key in _KEYS)


def describe_keys() -> str:
    """One line per key: its allowed values and its default."""
    return "\n".join(f"{key.name}: {key.allowed} (default {_show_default(key.default)})"
                     for key in _KEYS)


def _show_default(default: Any) -> str:
    return "[]" if default == () else _show(default)


@dataclass(frozen=True)
class HSDPConfig:
    """A validated config; list keys are tuples, dtypes are 'bf16'/'fp16'/'fp32'.
    Constructing one directly validates it the same way :func:`load_config` does."""

    sharding_size: int | str = AUTO
    fsdp_outer_degree: int | str = AUTO
    fsdp_outer_sharding: str = AUTO
    sub_modules_to_wrap: tuple = ()
    ignored_modules: tuple = ()
    recompute_modules: tuple = ()
    expert_modules: tuple = ()
    use_reentrant: bool = True
    reshard_after_forward: bool | None = None
    zero_stage: int | None = None
    cast_forward_inputs: bool = True
    offload_to_cpu: bool = False
    pin_memory: bool = False
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    fsdp_outer_compress: str | None = None
    fsdp_outer_compress_block: int = 256
    fsdp_outer_sync_every: int = 1
    fsdp_outer_optimizer: dict | None = None
    fsdp_outer_sync_fragments: int = 1
    owned_matrices: bool = False
    output_dtype: str | None = None
    sync_module_states: bool = True
    num_to_forward_prefetch: int = 1
    num_to_backward_prefetch: int = 1
    source: str = DICT_SOURCE

    def __post_init__(self):
        values = {name: getattr(self, name) for name in VALID_KEYS}
        normalised, errors = _validate_values(values)
        if errors:
            raise ConfigError(errors)
        for name, value in normalised.items():
            # frozen: normalising (list -> tuple, 'bfloat16' -> 'bf16') needs the bypass
            object.__setattr__(self, name, value)


# ------------------------------------------------------------------------- validation
def _validate_values(values: dict) -> tuple[dict, list[str]]:
    """Check every known key in ``values``, then the rules between keys; return the
    normalised values of the keys that passed and every error."""
    normalised: dict[str, Any] = {}
    errors: list[str] = []
    for name, value in values.items():
        try:
            normalised[name] = _KEY_BY_NAME[name].validate(value)
        except _Invalid as invalid:
            errors.extend(_prefix(name, message) for message in invalid.messages)
    errors.extend(_cross_key_errors(normalised))
    return normalised, errors


def _prefix(name: str, message: str) -> str:
    # list-item problems come as '[i]: ...' and read as 'key[i]: ...'
    return f"{name}{message}" if message.startswith("[") else f"{name}: {message}"


def _cross_key_errors(values: dict) -> list[str]:
    errors = []
    if values.get("pin_memory") is True and values.get("offload_to_cpu") is not True:
        errors.append("pin_memory: true needs offload_to_cpu: true (pinned memory only "
                      "holds CPU-offloaded shards); set offload_to_cpu: true or drop "
                      "pin_memory")
    if values.get("zero_stage") is not None and values.get("reshard_after_forward") is not None:
        errors.append("zero_stage: conflicts with reshard_after_forward (zero_stage sets it: "
                      "3 -> true, 1 and 2 -> false); keep zero_stage to also choose when "
                      "grads sync, or keep reshard_after_forward alone")
    every = values.get("fsdp_outer_sync_every", 1)
    if every == 1 and values.get("fsdp_outer_optimizer") is not None:
        errors.append("fsdp_outer_optimizer: unused with fsdp_outer_sync_every: 1 (plain "
                      "HSDP averages the grads every step); set fsdp_outer_sync_every "
                      ">= 2 or drop fsdp_outer_optimizer")
    fragments = values.get("fsdp_outer_sync_fragments", 1)
    if fragments != 1 and (not isinstance(every, int) or fragments > every):
        errors.append(f"fsdp_outer_sync_fragments: {fragments} needs fsdp_outer_sync_every "
                      f">= {fragments} (each fragment syncs every H steps, at its own step "
                      f"of the interval); got fsdp_outer_sync_every: {every}")
    if every != 1 and values.get("fsdp_outer_sharding") == "optim":
        errors.append("fsdp_outer_sync_every: > 1 (DiLoCo) conflicts with "
                      "fsdp_outer_sharding: optim (each replica's optimizer would hold 1/O "
                      "of the state, so replicas cannot step apart); use "
                      "fsdp_outer_sharding: none")
    return errors


def _unknown_key_error(name: Any) -> str:
    valid = "Valid keys: " + ", ".join(VALID_KEYS)
    if not isinstance(name, str):
        return f"{_show(name)}: unknown key (keys are strings). {valid}"
    return f"{name}: unknown key{did_you_mean(name, VALID_KEYS)} {valid}"


# ---------------------------------------------------------------------------- loading
def load_config(source: str | os.PathLike | dict | HSDPConfig) -> HSDPConfig:
    """An :class:`HSDPConfig` from a YAML file path (str or os.PathLike), a dict, or an
    :class:`HSDPConfig` (returned as is). Every problem is collected and raised together
    as one :class:`ConfigError`; an empty file gives all defaults."""
    if isinstance(source, HSDPConfig):
        return source
    if isinstance(source, dict):
        return _from_mapping(source, DICT_SOURCE)
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        return _from_mapping(_read_yaml(path), path)
    raise TypeError(f"load_config: expected a YAML file path (str or os.PathLike), a dict "
                    f"or an HSDPConfig, got {type(source).__name__}")


def _strict_loader() -> type[yaml.SafeLoader]:
    """A SafeLoader that refuses a key written twice (safe_load keeps the last one
    silently, so a config could say one thing and do another)."""
    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
            seen: dict = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"{key}: written twice (first at line {seen[key] + 1}); "
                        "keep one", key_node.start_mark)
                seen[key] = key_node.start_mark.line
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


def _read_yaml(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.load(handle, Loader=_strict_loader())
    except FileNotFoundError:
        raise ConfigError([f"{path}: config file not found"]) from None
    except IsADirectoryError:
        raise ConfigError([f"{path}: is a directory, not a YAML config file"]) from None
    except OSError as error:
        raise ConfigError([f"{path}: cannot read the config file: {error.strerror}"]) from None
    except UnicodeDecodeError as error:
        raise ConfigError([f"{path}: not UTF-8 text ({error.reason})"]) from None
    except yaml.YAMLError as error:
        raise ConfigError([_yaml_error_message(path, error)]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: the top level must be a mapping of keys to values "
                           f"(key: value lines), got {_show_with_kind(data)}"])
    return data


def _yaml_error_message(path: str, error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(error, "problem", None) or str(error)
    return f"{path}: not valid YAML{where}: {problem}"


def _from_mapping(mapping: dict, source: str) -> HSDPConfig:
    errors = [_unknown_key_error(name) for name in mapping if name not in _KEY_BY_NAME]
    known = {name: value for name, value in mapping.items() if name in _KEY_BY_NAME}
    normalised, value_errors = _validate_values(known)
    errors.extend(value_errors)
    if errors:
        raise ConfigError(errors)
    return HSDPConfig(**normalised, source=source)


# ------------------------------------------------------------------ degree resolution
def resolve_degrees(config: str | os.PathLike | dict | HSDPConfig, world_size: int,
                    ranks_per_node: int | None) -> tuple[int, int]:
    """``(outer, inner)`` with ``outer * inner == world_size``: ``inner`` ranks share one
    shard group (``sharding_size``), ``outer`` replicas (``fsdp_outer_degree``).

    With both 'auto', shard within a node when ``ranks_per_node`` divides the world
    (cross-node traffic is then only the outer all-reduce), else shard over all ranks.
    """
    config = load_config(config)
    _check_world(world_size, ranks_per_node)
    inner, outer = _fixed(config.sharding_size), _fixed(config.fsdp_outer_degree)
    errors = [_divisor_error(name, value, world_size)
              for name, value in (("sharding_size", inner), ("fsdp_outer_degree", outer))
              if value is not None and world_size % value]
    if not errors and inner is not None and outer is not None and inner * outer != world_size:
        errors.append(f"sharding_size * fsdp_outer_degree: {inner} * {outer} = "
                      f"{inner * outer}, but the world size is {world_size}; the product "
                      "must equal the world size (or set one of them to 'auto')")
    if errors:
        raise ConfigError(errors)
    if inner is not None:
        return world_size // inner, inner
    if outer is not None:
        return outer, world_size // outer
    return _auto_degrees(world_size, ranks_per_node)


def _fixed(degree: int | str) -> int | None:
    """A validated degree: its int, or None for 'auto' (the only string it can be)."""
    return degree if isinstance(degree, int) else None


def _check_world(world_size: Any, ranks_per_node: Any) -> None:
    if not _is_int(world_size) or world_size < 1:
        raise ValueError(f"resolve_degrees: world_size must be an int >= 1, "
                         f"got {world_size!r}")
    if ranks_per_node is not None and (not _is_int(ranks_per_node) or ranks_per_node < 1):
        raise ValueError(f"resolve_degrees: ranks_per_node must be None or an int >= 1, "
                         f"got {ranks_per_node!r}")


def _auto_degrees(world_size: int, ranks_per_node: int | None) -> tuple[int, int]:
    if ranks_per_node is not None and world_size % ranks_per_node == 0:
        return world_size // ranks_per_node, ranks_per_node
    return 1, world_size


def _divisor_error(name: str, value: int, world_size: int) -> str:
    divisors = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
    return (f"{name}: {value} does not divide the world size {world_size}; allowed: "
            f"{divisors} or 'auto'")


def ranks_per_node_from_env() -> int | None:
    """Ranks on this node, from ``PADDLE_LOCAL_SIZE`` (set by
    ``python -m paddle.distributed.launch``); None when unset or not an int >= 1."""
    text = os.environ.get(LOCAL_SIZE_ENV, "").strip()
    if not text.isascii() or not text.isdigit() or int(text) < 1:
        return None
    return int(text)
