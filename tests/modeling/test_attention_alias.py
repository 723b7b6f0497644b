"""linearformers.modeling.attention, the deprecated alias of linearformers.ops (and of linearformers.seeds): the old
import paths still work, with a FutureWarning naming the version the alias goes away in. A fresh process, so that
the warning is raised by this import and not by an earlier one."""

import subprocess
import sys

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
import warnings
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
