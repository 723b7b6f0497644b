"""The shared stack's modules (linearformers/modeling/layers.py)."""

import pytest

from linearformers.modeling import layers


def test_the_blocks_old_name_still_imports_with_a_warning_that_names_its_removal():
    with pytest.warns(FutureWarning, match=r"LinearAttentionBlock.*0\.3\.0"):
        from linearformers.modeling.layers import LinearAttentionLayer
    assert LinearAttentionLayer is layers.LinearAttentionBlock


def test_a_name_the_module_lacks_still_raises_attribute_error():
    with pytest.raises(AttributeError, match="LinearAttentionBlok"):
        layers.LinearAttentionBlok  # noqa: B018
