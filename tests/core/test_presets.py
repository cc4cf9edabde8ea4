"""Guards ``core/settings/presets.py``: every named correction is a valid loss section, and says what its name says.

The presets are the one definition the tools, the recipes and the docs read (the recipes' and
the guide's numbers are held to them by tests/docs and tests/tools); here each fragment is
built as the loss builds it, with no warning, and its filters and parameters are checked
against the peers' definitions the preset names (prime-rl's DPPO and IPO masks, TIS's cap).
"""

import warnings

import pytest

from nemo_rs_plugin.core.settings import presets
from nemo_rs_plugin.core.settings.config import RSClippedPGLossConfig, SequenceFilter, TokenFilter

SECTIONS = {
    **{f"filter {name}": {**presets.IS_ON, "rejection_sampling": [f]} for name, f in presets.FILTERS.items()},
    **{f"is_level {level}": presets.is_level(level) for level in ("token", "sequence", "sequence_mean")},
    **{f"tis {level}": presets.tis(level) for level in ("token", "sequence", "sequence_mean")},
    "dppo": presets.dppo(),
    "ipo": presets.ipo(),
}


@pytest.mark.parametrize("name", list(SECTIONS))
def test_every_preset_is_a_valid_section_without_warnings(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RSClippedPGLossConfig.from_any(SECTIONS[name])


def test_the_named_filters_are_the_kinds_and_bands_their_sources_give():
    built = {
        name: RSClippedPGLossConfig.from_any(s).rejection_sampling[0]
        for name, s in SECTIONS.items()
        if "filter" in name
    }
    geo, veto, mis = built["filter geo-rs"], built["filter outlier-veto"], built["filter token-mis"]
    assert isinstance(geo, SequenceFilter) and (geo.aggregation, geo.lower, geo.upper) == ("mean", 0.99, 1.01)
    assert isinstance(veto, SequenceFilter) and (veto.aggregation, veto.lower, veto.upper) == ("any", 1e-4, 1e4)
    assert isinstance(mis, TokenFilter) and (mis.lower, mis.upper) == (0.5, 2.0)


def test_tis_truncates_at_its_cap_at_the_level_asked():
    cfg = RSClippedPGLossConfig.from_any(presets.tis("sequence_mean", cap=3.0))
    assert cfg.effective_is_level == "sequence_mean"
    assert (cfg.truncated_importance_sampling_type, cfg.truncated_importance_sampling_ratio) == ("tis", 3.0)


def test_dppo_drops_the_policy_term_per_advantage_sign_with_its_own_bounds():
    cfg = RSClippedPGLossConfig.from_any(presets.dppo(mask_high=0.3, mask_low=0.1, kl_tau=0.01))
    high, low = cfg.rejection_sampling
    for f in (high, low):
        assert isinstance(f, TokenFilter)
        assert (f.statistic, f.log_ratio, f.applies_to) == ("prob_diff", "curr-gen", "policy_gradient")
    assert (high.advantage_sign, high.lower, high.upper) == ("positive", None, 0.3)
    assert (low.advantage_sign, low.lower, low.upper) == ("negative", -0.1, None)
    assert cfg.force_on_policy_ratio and cfg.sampler_kl_penalty == 0.01 and cfg.reference_policy_kl_penalty == 0.0


def test_ipo_is_one_two_sided_band_on_every_token():
    [f] = RSClippedPGLossConfig.from_any(presets.ipo(threshold=0.05)).rejection_sampling
    assert (f.advantage_sign, f.lower, f.upper, f.applies_to) == (None, -0.05, 0.05, "policy_gradient")


@pytest.mark.parametrize(
    "name, nemo_rl", [("clipped_pg", True), (None, True), ("rs_clipped_pg", False), ("other", False)]
)
def test_which_loss_name_selects_nemo_rls_own(name, nemo_rl):
    assert presets.selects_nemo_rl_loss(name) is nemo_rl
