"""The YAML config front end without a model sharded or a group made: module-path
patterns (:mod:`paddle_hsdp.config.patterns`) on small real paddle models, and the config
schema, its strict validation and degree resolution (:mod:`paddle_hsdp.config`)."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest
from paddle import nn

from paddle_hsdp.config import schema as hsdp_config
from paddle_hsdp.config.schema import (VALID_KEYS, ConfigError, HSDPConfig, describe_keys,
                                       load_config, ranks_per_node_from_env, resolve_degrees)
from paddle_hsdp.config.patterns import PatternError, match_modules, order_bottom_up, parse_pattern

NUM_BLOCKS = 6
KEY = "sub_modules_to_wrap"


class Block(nn.Layer):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.mlp = nn.Linear(4, 4)


class Inner(nn.Layer):
    def __init__(self):
        super().__init__()
        self.layers = nn.LayerList([Block() for _ in range(NUM_BLOCKS)])


class TinyLM(nn.Layer):
    def __init__(self):
        super().__init__()
        self.model = Inner()
        self.lm_head = nn.Linear(4, 4)


@pytest.fixture(scope="module")
def model():
    return TinyLM()


def paths(matches):
    return [path for path, _ in matches]


def block_paths(*indices):
    return [f"model.layers.{i}" for i in indices]


# ----------------------------------------------------------------- pattern matching
@pytest.mark.parametrize("pattern, expected", [
    ("model.layers.{*}", block_paths(*range(NUM_BLOCKS))),
    ("model.layers.{1,4}", block_paths(1, 4)),
    ("model.layers.{1-3}", block_paths(1, 2, 3)),
    ("model.layers.{0-1,4-5}", block_paths(0, 1, 4, 5)),
    ("model.layers.{0, 2}", block_paths(0, 2)),
    ("model.layers.{3}", block_paths(3)),
    ("model.layers.{2-2}", block_paths(2)),
    ("model.layers.{0,2}.attn", ["model.layers.0.attn", "model.layers.2.attn"]),
    ("lm_head", ["lm_head"]),
    ("model", ["model"]),
], ids=["any", "list", "range", "ranges", "spaces", "single", "one-range",
        "nested", "lower-case-path", "top"])
def test_path_patterns_select_in_sublayer_order(model, pattern, expected):
    assert paths(match_modules(model, [pattern], KEY)) == expected


def test_class_name_pattern_matches_every_instance(model):
    matches = match_modules(model, ["Block"], KEY)
    assert paths(matches) == block_paths(*range(NUM_BLOCKS))
    assert all(type(module) is Block for _, module in matches)
    assert len(match_modules(model, ["Linear"], KEY)) == 2 * NUM_BLOCKS + 1


def test_class_name_versus_path():
    assert parse_pattern("LlamaDecoderLayer").is_class_name
    for text in ("lm_head", "Model.layers", "Layers.{0}"):
        assert not parse_pattern(text).is_class_name


def test_pattern_matches_method(model):
    pattern = parse_pattern("model.layers.{1-2}.mlp")
    assert pattern.text == "model.layers.{1-2}.mlp"
    assert pattern.matches("model.layers.2.mlp", model.model.layers[2].mlp)
    assert not pattern.matches("model.layers.3.mlp", model.model.layers[3].mlp)
    assert not pattern.matches("model.layers.2", model.model.layers[2])
    assert not parse_pattern("layers.{*}").matches("layers.x", model)


def test_overlapping_patterns_give_each_module_once(model):
    matches = match_modules(model, ["Block", "model.layers.{0-2}", "model.layers.{1}"], KEY)
    assert paths(matches) == block_paths(*range(NUM_BLOCKS))


def test_order_bottom_up_puts_contained_modules_first(model):
    matches = match_modules(model, ["model", "model.layers.{0,1}", "model.layers.{0}.attn",
                                    "lm_head"], KEY)
    assert paths(matches) == ["model", "model.layers.0", "model.layers.0.attn",
                              "model.layers.1", "lm_head"]
    ordered = paths(order_bottom_up(matches))
    assert ordered == ["model.layers.0.attn", "model.layers.0", "model.layers.1", "model",
                       "lm_head"]
    for i, outer in enumerate(ordered):
        assert not any(inner.startswith(outer + ".") for inner in ordered[i + 1:])


# ---------------------------------------------------------------- malformed patterns
@pytest.mark.parametrize("text, problem", [
    ("layers.{5-2}", "start 5 > end 2"),
    ("layers.{a}", "'a' is not an int"),
    ("layers.{1-}", "has no end"),
    ("layers.{-3}", "negative number or a range with no start"),
    ("layers.{0--3}", "negative end"),
    ("layers.{}", "empty brace group"),
    ("layers.{1,}", "empty entry"),
    ("layers.{1", "'{' is never closed"),
    ("layers.1}", "'}' without a matching '{'"),
    ("layers.{{1}}", "'{' inside a brace group"),
    ("layers.{0.5}", "'.' inside a brace group"),
    ("layer{1}", "must be a whole path component"),
    ("layers.{*,1}", "'\\*' must stand alone"),
    ("layers.*", "write '{\\*}' for any index"),
    ("a..b", "empty path component"),
    (".a", "empty path component"),
    ("a.", "empty path component"),
    ("", "empty pattern"),
    ("lm head", "whitespace"),
], ids=["reversed-range", "not-int", "no-end", "negative", "negative-end", "empty-group",
        "empty-entry", "unclosed", "unopened", "nested", "dot-inside", "partial-component",
        "star-with-others", "glob", "double-dot", "leading-dot", "trailing-dot", "empty",
        "space"])
def test_malformed_pattern_names_pattern_problem_and_syntax(text, problem):
    with pytest.raises(PatternError, match=problem) as caught:
        parse_pattern(text)
    message = str(caught.value)
    assert f"pattern {text!r}" in message
    assert "allowed:" in message and "{*}" in message


def test_pattern_error_is_a_value_error():
    assert issubclass(PatternError, ValueError)


@pytest.mark.parametrize("bad", [3, None, ["a"]], ids=["int", "none", "list"])
def test_non_string_pattern(bad):
    with pytest.raises(PatternError, match="expected a string"):
        parse_pattern(bad)


def test_match_modules_rejects_a_bare_string(model):
    with pytest.raises(PatternError, match=r"expected a list of patterns.*\['lm_head'\]"):
        match_modules(model, "lm_head", KEY)


def test_match_modules_reports_every_malformed_pattern(model):
    with pytest.raises(PatternError) as caught:
        match_modules(model, ["a..b", "lm_head", "{x}"], KEY)
    lines = str(caught.value).splitlines()
    assert len(lines) == 2
    assert all(line.startswith(f"{KEY}: pattern") for line in lines)


# ------------------------------------------------------------------- non-matching
def test_non_matching_path_names_key_pattern_and_nearest_path(model):
    with pytest.raises(PatternError) as caught:
        match_modules(model, ["model.layer.{*}"], KEY)
    message = str(caught.value)
    assert message.startswith(f"{KEY}: pattern 'model.layer.{{*}}' matches no sub-module")
    assert "nearest paths: " in message and "'model.layers.0'" in message


def test_non_matching_class_name_suggests_real_class(model):
    with pytest.raises(PatternError, match=r"class 'Blok'.*nearest class names: 'Block'"):
        match_modules(model, ["Blok"], "recompute_modules")


def test_out_of_range_indices_say_which_exist(model):
    with pytest.raises(PatternError, match=r"indices present at component 3: 0-5"):
        match_modules(model, ["model.layers.{7-9}"], KEY)


@pytest.mark.parametrize("pattern, missing", [("model.layers.{4-100}", "6-100"),
                                              ("model.layers.{0-2,7}.attn", "7")])
def test_indices_partly_past_the_model_are_refused_with_the_real_range(model, pattern, missing):
    """A range written for a deeper model is a slip whether it overlaps the model's
    indices or not: refused, naming what is missing and what exists."""
    with pytest.raises(PatternError) as caught:
        match_modules(model, [pattern], KEY)
    message = str(caught.value)
    assert message.startswith(f"{KEY}: pattern {pattern!r} names indices {missing} ")
    assert "indices present there: 0-5" in message


def test_every_non_matching_pattern_is_reported_together(model):
    with pytest.raises(PatternError) as caught:
        match_modules(model, ["lm_head", "lm_haed", "Blok", "model.layers.{9}"], KEY)
    lines = str(caught.value).splitlines()
    assert len(lines) == 3
    assert "'lm_haed'" in lines[0] and "'lm_head'" in lines[0]
    assert "'Blok'" in lines[1] and "'model.layers.{9}'" in lines[2]


def test_no_close_match_lists_real_paths(model):
    with pytest.raises(PatternError, match=r"no close match; the model's first paths: 'model'"):
        match_modules(model, ["zzzzzzzzzzzzzzzzzzz"], KEY)


# ------------------------------------------------------------------ config loading
FULL_YAML = """\
sharding_size: 4
fsdp_outer_degree: 2
sub_modules_to_wrap:
  - model.layers.{*}
  - lm_head
ignored_modules: [model.embed]
recompute_modules:
  - LlamaDecoderLayer
expert_modules: ["model.layers.{0-20,22-40}.mlp.experts"]
use_reentrant: false
reshard_after_forward: true
cast_forward_inputs: false
offload_to_cpu: true
pin_memory: true
param_dtype: bfloat16
reduce_dtype: fp32
output_dtype: float16
num_to_forward_prefetch: 2
num_to_backward_prefetch: 0
"""


def write(tmp_path, text, name="hsdp.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def test_full_yaml_file_loads_and_normalises(tmp_path):
    path = write(tmp_path, FULL_YAML)
    config = load_config(path)
    assert config == HSDPConfig(
        sharding_size=4, fsdp_outer_degree=2,
        sub_modules_to_wrap=("model.layers.{*}", "lm_head"),
        ignored_modules=("model.embed",), recompute_modules=("LlamaDecoderLayer",),
        expert_modules=("model.layers.{0-20,22-40}.mlp.experts",),
        use_reentrant=False, reshard_after_forward=True, cast_forward_inputs=False,
        offload_to_cpu=True, pin_memory=True, param_dtype="bf16", reduce_dtype="fp32",
        output_dtype="fp16", num_to_forward_prefetch=2, num_to_backward_prefetch=0,
        source=str(path))
    assert load_config(str(path)) == config
    assert load_config(config) is config


def test_round_trip_through_a_dict(tmp_path):
    config = load_config(write(tmp_path, FULL_YAML))
    as_dict = {name: getattr(config, name) for name in VALID_KEYS}
    as_dict = {name: list(value) if isinstance(value, tuple) else value
               for name, value in as_dict.items()}
    assert dataclasses.replace(load_config(as_dict), source=config.source) == config


def test_empty_file_and_empty_dict_are_all_defaults(tmp_path):
    defaults = HSDPConfig()
    from_file = load_config(write(tmp_path, "# nothing set\n"))
    assert dataclasses.replace(from_file, source="<dict>") == defaults
    assert load_config({}) == defaults
    assert defaults.sharding_size == "auto" and defaults.fsdp_outer_degree == "auto"
    assert defaults.sub_modules_to_wrap == () and defaults.use_reentrant is True
    assert defaults.reshard_after_forward is None and defaults.zero_stage is None
    assert defaults.num_to_forward_prefetch == 1 and defaults.num_to_backward_prefetch == 1
    assert defaults.source == "<dict>"


def test_dict_input_and_dtype_aliases():
    config = load_config({"zero_stage": 2, "param_dtype": "float32", "reduce_dtype": "bf16",
                          "ignored_modules": ["lm_head"]})
    assert config.zero_stage == 2 and config.param_dtype == "fp32"
    assert config.reduce_dtype == "bf16" and config.ignored_modules == ("lm_head",)
    assert config.source == "<dict>"


def test_reduce_dtype_without_param_dtype_is_fine():
    assert load_config({"reduce_dtype": "fp32"}).param_dtype is None


def test_schema_and_dataclass_agree():
    names = tuple(field.name for field in dataclasses.fields(HSDPConfig))
    assert names == VALID_KEYS + ("source",)
    for line, name in zip(describe_keys().splitlines(), VALID_KEYS):
        assert line.startswith(f"{name}: ") and "(default " in line


def test_direct_construction_is_validated_too():
    with pytest.raises(ConfigError, match="zero_stage: expected null or one of 1, 2, 3"):
        HSDPConfig(zero_stage=5)
    assert HSDPConfig(sub_modules_to_wrap=["lm_head"]).sub_modules_to_wrap == ("lm_head",)


# ---------------------------------------------------------------- strictness errors
def error_lines(source) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_config(source)
    assert str(caught.value) == "\n".join(caught.value.errors)
    return caught.value.errors


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_unknown_key_suggests_the_closest():
    [line] = error_lines({"sharding_sise": 4})
    assert line.startswith("sharding_sise: unknown key; did you mean 'sharding_size'? "
                           "Valid keys: sharding_size, fsdp_outer_degree,")


def test_unknown_key_without_a_close_one():
    [line] = error_lines({"learning_rate": 0.1})
    assert line.startswith("learning_rate: unknown key. Valid keys: ")


@pytest.mark.parametrize("key, value, expected", [
    ("use_reentrant", 1, "use_reentrant: expected true or false, got 1 (an int)"),
    ("offload_to_cpu", "yes", "offload_to_cpu: expected true or false, got 'yes' (a string); "
                              "write true or false without quotes"),
    ("reshard_after_forward", "true", "reshard_after_forward: expected true, false or null, "
                                      "got 'true' (a string)"),
    ("num_to_forward_prefetch", 2.5, "num_to_forward_prefetch: expected an int >= 0, "
                                     "got 2.5 (a float)"),
    ("num_to_backward_prefetch", True, "num_to_backward_prefetch: expected an int >= 0, "
                                       "got true (a bool)"),
    ("sharding_size", True, "sharding_size: expected 'auto' or an int >= 1 (ranks per shard "
                            "group), got true (a bool)"),
    ("fsdp_outer_degree", "2", "fsdp_outer_degree: expected 'auto' or an int >= 1 (number "
                               "of replicas), got '2' (a string)"),
    ("zero_stage", 3.0, "zero_stage: expected null or one of 1, 2, 3, got 3.0 (a float)"),
    ("param_dtype", 16, "param_dtype: expected null or one of 'bf16'"),
    ("sub_modules_to_wrap", "lm_head", "sub_modules_to_wrap: expected a list of module "
                                       "patterns"),
    ("ignored_modules", {"a": 1}, "ignored_modules: expected a list of module patterns "
                                  "(path like 'layers.{*}' or class name), got a mapping"),
    ("expert_modules", None, "expert_modules: expected a list of module patterns"),
], ids=["bool-as-int", "bool-as-yes-string", "optional-bool-as-string", "int-as-float",
        "int-as-bool", "degree-as-bool", "degree-as-string", "stage-as-float",
        "dtype-as-int", "list-as-string", "list-as-mapping", "list-as-null"])
def test_wrong_type(key, value, expected):
    [line] = error_lines({key: value})
    assert line.startswith(expected)


def test_string_instead_of_list_says_to_use_a_list():
    [line] = error_lines({"recompute_modules": "Block"})
    assert "a single pattern must still be a list: ['Block']" in line


@pytest.mark.parametrize("key, value, expected", [
    ("zero_stage", 4, "zero_stage: expected null or one of 1, 2, 3, got 4"),
    ("zero_stage", 0, "zero_stage: expected null or one of 1, 2, 3, got 0"),
    ("param_dtype", "fp8", "param_dtype: expected null or one of 'bf16', 'fp16', 'fp32' "
                           "(or 'bfloat16', 'float16', 'float32'), got 'fp8'"),
    ("output_dtype", "BF16", "output_dtype: expected null or one of 'bf16', 'fp16', 'fp32' "
                             "(or 'bfloat16', 'float16', 'float32'), got 'BF16'"),
    ("num_to_forward_prefetch", -1, "num_to_forward_prefetch: expected an int >= 0, got -1"),
    ("sharding_size", 0, "sharding_size: expected 'auto' or an int >= 1 (ranks per shard "
                         "group), got 0"),
    ("fsdp_outer_degree", "Auto", "fsdp_outer_degree: expected 'auto' or an int >= 1 (number "
                                  "of replicas), got 'Auto' (a string)"),
    ("fsdp_outer_sharding", "zero1", "fsdp_outer_sharding: expected 'auto', 'none' or 'optim' "
                                     "(optim: the optimizer state is sharded across the outer "
                                     "replicas too, HFSDP), got 'zero1'"),
    ("fsdp_outer_sharding", True, "fsdp_outer_sharding: expected 'auto', 'none' or 'optim' "
                                  "(optim: the optimizer state is sharded across the outer "
                                  "replicas too, HFSDP), got true (a bool)"),
], ids=["stage-4", "stage-0", "fp8", "upper-case-dtype", "negative-prefetch", "zero-size",
        "capital-auto", "outer-sharding-value", "outer-sharding-type"])
def test_out_of_set_values(key, value, expected):
    assert error_lines({key: value}) == [expected]


def test_bad_pattern_inside_a_list_names_key_and_index():
    lines = error_lines({"sub_modules_to_wrap": ["lm_head", "layers.{5-2}", 7]})
    assert len(lines) == 2
    assert lines[0].startswith("sub_modules_to_wrap[1]: pattern 'layers.{5-2}': range")
    assert lines[1].startswith("sub_modules_to_wrap[2]: pattern 7: expected a string")


def test_pin_memory_needs_offload():
    [line] = error_lines({"pin_memory": True})
    assert line.startswith("pin_memory: true needs offload_to_cpu: true")
    assert load_config({"pin_memory": True, "offload_to_cpu": True}).pin_memory is True


def test_zero_stage_conflicts_with_reshard_after_forward():
    [line] = error_lines({"zero_stage": 3, "reshard_after_forward": False})
    assert line.startswith("zero_stage: conflicts with reshard_after_forward")
    assert "keep zero_stage" in line and "keep reshard_after_forward" in line


def test_several_errors_reported_together():
    lines = error_lines({"sharding_sise": 2, "use_reentrant": 0, "zero_stage": 4,
                         "num_to_backward_prefetch": -2, "pin_memory": True,
                         "ignored_modules": "lm_head"})
    assert [line.split(":")[0] for line in lines] == [
        "sharding_sise", "use_reentrant", "zero_stage", "num_to_backward_prefetch",
        "ignored_modules", "pin_memory"]


def test_errors_from_a_file_are_the_same(tmp_path):
    lines = error_lines(write(tmp_path, """\
        use_reentrant: 1
        num_to_forward_prefetch: -1
        """))
    assert lines == ["use_reentrant: expected true or false, got 1 (an int)",
                     "num_to_forward_prefetch: expected an int >= 0, got -1"]


@pytest.mark.parametrize("text, kind", [("- a\n- b\n", "a list"), ("just text\n", "'just text'"),
                                        ("42\n", "42 (an int)")],
                         ids=["list", "string", "int"])
def test_non_mapping_top_level(tmp_path, text, kind):
    path = write(tmp_path, text)
    [line] = error_lines(path)
    assert line == (f"{path}: the top level must be a mapping of keys to values "
                    f"(key: value lines), got {kind}" + (" (a string)" if kind[0] == "'" else ""))


def test_yaml_syntax_error_reports_line_and_column(tmp_path):
    path = write(tmp_path, """\
        sharding_size: 4
        sub_modules_to_wrap: [lm_head
        zero_stage: 3
        """)
    [line] = error_lines(path)
    assert line.startswith(f"{path}: not valid YAML at line ")
    assert ", column " in line


def test_yaml_bad_indent_points_at_the_line(tmp_path):
    path = write(tmp_path, "sharding_size: 4\n  zero_stage: 3\n")
    [line] = error_lines(path)
    assert line.startswith(f"{path}: not valid YAML at line 2, column ")


def test_missing_file(tmp_path):
    path = tmp_path / "absent.yaml"
    assert error_lines(path) == [f"{path}: config file not found"]


def test_directory_is_not_a_config(tmp_path):
    [line] = error_lines(tmp_path)
    assert "is a directory" in line


def test_wrong_source_type():
    with pytest.raises(TypeError, match="YAML file path.*dict.*HSDPConfig"):
        load_config(["sharding_size", 4])


# ------------------------------------------------------------------ degree resolution
@pytest.mark.parametrize("settings, world, per_node, expected", [
    ({}, 16, 8, (2, 8)),
    ({}, 8, 8, (1, 8)),
    ({}, 8, None, (1, 8)),
    ({}, 12, 8, (1, 12)),
    ({}, 4, 8, (1, 4)),
    ({"sharding_size": 4}, 16, 8, (4, 4)),
    ({"fsdp_outer_degree": 4}, 16, 8, (4, 4)),
    ({"sharding_size": 2, "fsdp_outer_degree": 4}, 8, None, (4, 2)),
    ({"sharding_size": 1}, 4, None, (4, 1)),
    ({"fsdp_outer_degree": 1}, 1, None, (1, 1)),
], ids=["auto-per-node", "auto-one-node", "auto-no-node-info", "auto-node-not-divisor",
        "auto-node-bigger", "inner-set", "outer-set", "both-set", "pure-dp", "single-rank"])
def test_resolve_degrees(settings, world, per_node, expected):
    outer, inner = resolve_degrees(load_config(settings), world, per_node)
    assert (outer, inner) == expected and outer * inner == world


def test_resolve_degrees_accepts_a_dict():
    assert resolve_degrees({"sharding_size": 2}, 4, None) == (2, 2)


@pytest.mark.parametrize("settings, expected", [
    ({"sharding_size": 3}, ["sharding_size: 3 does not divide the world size 8; allowed: "
                            "1, 2, 4, 8 or 'auto'"]),
    ({"fsdp_outer_degree": 16}, ["fsdp_outer_degree: 16 does not divide the world size 8; "
                                 "allowed: 1, 2, 4, 8 or 'auto'"]),
    ({"sharding_size": 2, "fsdp_outer_degree": 2},
     ["sharding_size * fsdp_outer_degree: 2 * 2 = 4, but the world size is 8; the product "
      "must equal the world size (or set one of them to 'auto')"]),
    ({"sharding_size": 3, "fsdp_outer_degree": 5},
     ["sharding_size: 3 does not divide the world size 8; allowed: 1, 2, 4, 8 or 'auto'",
      "fsdp_outer_degree: 5 does not divide the world size 8; allowed: 1, 2, 4, 8 or 'auto'"]),
], ids=["inner-not-divisor", "outer-not-divisor", "product", "both-not-divisors"])
def test_resolve_degrees_errors(settings, expected):
    with pytest.raises(ConfigError) as caught:
        resolve_degrees(load_config(settings), 8, None)
    assert caught.value.errors == expected


@pytest.mark.parametrize("world, per_node", [(0, None), (True, None), (8, 0), (8, 2.0)])
def test_resolve_degrees_checks_its_arguments(world, per_node):
    with pytest.raises(ValueError, match="resolve_degrees: "):
        resolve_degrees(HSDPConfig(), world, per_node)


@pytest.mark.parametrize("value, expected", [
    (None, None), ("8", 8), (" 4 ", 4), ("0", None), ("-2", None), ("eight", None), ("", None),
])
def test_ranks_per_node_from_env(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(hsdp_config.LOCAL_SIZE_ENV, raising=False)
    else:
        monkeypatch.setenv(hsdp_config.LOCAL_SIZE_ENV, value)
    assert ranks_per_node_from_env() == expected


def test_a_key_written_twice_is_refused(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("zero_stage: 3\nsharding_size: 2\nzero_stage: 2\n")
    with pytest.raises(ConfigError, match="zero_stage: written twice"):
        load_config(path)
