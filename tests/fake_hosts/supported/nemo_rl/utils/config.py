import os

import yaml


def _merge(base, override):
    # Like OmegaConf.merge: mappings merge key by key; any other value replaces.
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            out[key] = _merge(base.get(key), value) if key in base else value
        return out
    return override


def load_config(config_path):
    with open(config_path) as fh:
        cfg = yaml.safe_load(fh) or {}
    defaults = cfg.pop("defaults", None)
    if defaults is None:
        return cfg
    if isinstance(defaults, str):
        defaults = [defaults]
    base = os.path.dirname(os.path.abspath(config_path))
    merged = {}
    for parent in defaults:
        merged = _merge(merged, load_config(os.path.join(base, str(parent))))
    return _merge(merged, cfg)
