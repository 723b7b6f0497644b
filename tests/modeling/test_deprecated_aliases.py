"""The deprecated old paths: linearformers.modeling.attention (now linearformers.ops and linearformers.seeds),
linearformers.modeling.convert / .transfer (now linearformers.conversion) and linearformers.modeling.layers (now
linearformers.modeling.base) still import, with a FutureWarning naming the version they go away in. The package
paths are checked in a fresh process each, so that the warning comes from their own import."""

import subprocess
import sys

import pytest

# the names linearformers.modeling.attention exported before the move
OLD_NAMES = (
    "BACKENDS BIDIRECTIONAL_BACKENDS CAUSAL_BACKENDS FAVOR_BACKENDS KERNELS LINFORMER_BACKENDS "
    "LINFORMER_CAUSAL_BACKENDS METHODS PERFORMER_KERNELS FavorPositive FeatureMap HedgehogFeatureMap HybridState "
    "ReluFeatures causal_linformer_attention causal_linformer_step causal_local_attention compact "
    "draw_random_features favor_attention favor_features favor_positive favor_step hybrid_attention hybrid_step "
    "linear_attention linear_step linformer_attention linformer_hybrid_attention local_attention "
    "local_attention_step native_available native_walk_enabled num_relative_positions relu_features set_native_walk "
    "set_triton_kernels softmax_attention uncompact"
).split()

OLD_IMPORTS = f"""
OLD_NAMES = {OLD_NAMES!r}
import sys, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import linearformers.modeling.attention as old
    from linearformers.modeling.attention import favor_attention
    from linearformers.modeling.attention.favor import favor_step
    from linearformers.modeling.attention.reference import softmax_reference
    from linearformers.modeling.attention.seeds import mix_seed
    import linearformers.modeling.attention._native as old_native
import linearformers.ops, linearformers.ops.favor, linearformers.ops._native, linearformers.ops.reference
import linearformers.seeds
assert favor_attention is linearformers.ops.favor_attention
assert favor_step is linearformers.ops.favor.favor_step
assert softmax_reference is linearformers.ops.reference.softmax_reference
assert mix_seed is linearformers.seeds.mix_seed
assert old_native is linearformers.ops._native and old.favor is linearformers.ops.favor
import linearformers.modeling.attention._triton_linear as old_triton, linearformers.ops._triton_causal
assert old_triton is linearformers.ops._triton_causal
assert "linearformers.ops._triton_causal_kernels" not in sys.modules  # the alias imports without Triton
assert sorted(old.__all__) == sorted(OLD_NAMES) and all(hasattr(old, name) for name in OLD_NAMES)
assert old.LINFORMER_BACKENDS is linearformers.ops.linformer.BACKENDS
print("|".join(str(w.message) for w in caught if issubclass(w.category, FutureWarning)))
"""


def test_old_attention_paths_import_the_ops_modules_with_a_future_warning():
    done = subprocess.run([sys.executable, "-c", OLD_IMPORTS], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    warnings = done.stdout.strip().split("|")
    assert len(warnings) == 1
    assert "linearformers.modeling.attention" in warnings[0]
    assert "0.3.0" in warnings[0] and "linearformers.ops" in warnings[0]


OLD_CONVERSION_IMPORTS = """
import warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import linearformers.modeling.convert as old_convert
    from linearformers.modeling.transfer import TransferArguments, _distillation_loss
import linearformers.conversion.convert, linearformers.conversion.transfer
assert old_convert is linearformers.conversion.convert
assert TransferArguments is linearformers.conversion.transfer.TransferArguments
assert _distillation_loss is linearformers.conversion.transfer._distillation_loss
print("|".join(str(w.message) for w in caught if issubclass(w.category, FutureWarning)))
"""


def test_old_conversion_paths_are_the_conversion_modules_with_a_future_warning_each():
    done = subprocess.run([sys.executable, "-c", OLD_CONVERSION_IMPORTS], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    warnings = done.stdout.strip().split("|")
    assert [w.split(" is deprecated")[0] for w in warnings] == [
        "linearformers.modeling.convert",
        "linearformers.modeling.transfer",
    ]
    assert all("0.3.0" in w and "linearformers.conversion." in w for w in warnings)


def test_the_old_conversion_command_still_runs():
    done = subprocess.run(
        [sys.executable, "-m", "linearformers.modeling.convert", "--help"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "--family" in done.stdout and "is deprecated" in done.stderr


def test_the_old_layers_module_gives_the_base_modules_with_a_warning_that_names_its_removal():
    import linearformers.modeling.base as base
    import linearformers.modeling.layers as layers

    with pytest.warns(FutureWarning, match=r"modeling\.base\.LinearAttentionBlock.*0\.3\.0"):
        from linearformers.modeling.layers import LinearAttentionLayer
    assert LinearAttentionLayer is base.LinearAttentionBlock
    with pytest.warns(FutureWarning, match=r"modeling\.base\.LinearAttention\b.*0\.3\.0"):
        assert layers.LinearAttention is base.LinearAttention


def test_a_name_the_old_layers_module_never_had_raises_attribute_error():
    import linearformers.modeling.layers as layers

    with pytest.raises(AttributeError, match="LinearAttentionBlok"):
        layers.LinearAttentionBlok  # noqa: B018
