"""Nothing leaves the default tier unsaid: the tests `make test` collects are the ones tests/default_tier.txt names,
and a test that left it is in tests/moved_to_full.toml with the reason (and is still collected by `make
test-full`). Making the suite cheaper must not make it prove less (support/inventory.py)."""

from __future__ import annotations

from support.inventory import collected, listed, moved


def test_the_default_tier_still_holds_every_proof_it_held():
    now, before, gone_on_purpose = set(collected()), set(listed()), moved()
    lost = sorted(before - now - set(gone_on_purpose))
    assert not lost, (f"{len(lost)} tests left the default tier without a reason in tests/moved_to_full.toml: {lost[:20]}")
    new = sorted(now - before)
    assert not new, (f"{len(new)} tests are not in tests/default_tier.txt yet: run python tests/support/inventory.py "
                     f"(and read its diff): {new[:20]}")
    back = sorted(now & set(gone_on_purpose))
    assert not back, f"in the default tier and in tests/moved_to_full.toml: {back}"
    for test, why in gone_on_purpose.items():
        assert len(why) > 20, f"{test}: say why it moved (which cell covers the same path in the default tier)"
