"""The loss registry: built-ins, registration rules, entry points, lookup errors."""

from importlib import metadata

import pytest

from nemo_rs_plugin.nemo_rl import registry


@pytest.fixture
def clean_registry(monkeypatch):
    """Snapshot and restore the module-level registry (never clear the real one)."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    yield registry


class MyLoss:
    pass


class OtherLoss:
    pass


def test_builtins_are_listed(clean_registry):
    names = clean_registry.list_registered()
    assert "rs_clipped_pg" in names and "clipped_pg" in names


def test_unknown_name_lists_known_names(clean_registry):
    with pytest.raises(registry.LossRegistryError, match=r"got 'rs_clipped'; known losses: .*rs_clipped_pg"):
        clean_registry.get_loss_class("rs_clipped")


def test_decorator_and_duplicates(clean_registry):
    clean_registry.register_loss("my_loss")(MyLoss)
    assert clean_registry.get_loss_class("my_loss") is MyLoss
    clean_registry.register_loss("my_loss", MyLoss)  # same object again: harmless
    clean_registry.register_loss("my_loss", f"{__name__}:MyLoss")  # same target by path
    with pytest.raises(registry.LossRegistryError, match="already registered"):
        clean_registry.register_loss("my_loss", OtherLoss)


def test_import_paths_resolve_lazily(clean_registry):
    clean_registry.register_loss("by_path", f"{__name__}:OtherLoss")
    assert clean_registry.get_loss_class("by_path") is OtherLoss
    clean_registry.register_loss("broken", "no_such_module_xyz:Loss")
    with pytest.raises(ImportError, match="loss 'broken' -> no_such_module_xyz:Loss"):
        clean_registry.get_loss_class("broken")


def test_entry_points_are_discovered(clean_registry, monkeypatch):
    ep = metadata.EntryPoint(name="third_party", value=f"{__name__}:MyLoss", group=registry.ENTRY_POINT_GROUP)

    def fake_entry_points(group=None):
        return [ep] if group == registry.ENTRY_POINT_GROUP else []

    monkeypatch.setattr(registry.metadata, "entry_points", fake_entry_points)
    assert "third_party" in clean_registry.list_registered()
    assert clean_registry.get_loss_class("third_party") is MyLoss


def test_subclass_without_nemo_rl_explains_how_to_install():
    import nemo_rs_plugin

    try:
        import nemo_rl  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="NeMo-RL is not on PyPI"):
            nemo_rs_plugin.RSClippedPGLossFn
    else:
        pytest.skip("NeMo-RL is importable here")
