"""The loss section: its validated config, the checks that read it, and the named corrections (presets)."""
