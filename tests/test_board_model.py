"""dpbench/board/board_model.py: the model fitted to board v3's records, and the boards it
simulates, have the structure the design study relies on."""

import numpy as np

from dpbench.board import board_model as bm
from tests.conftest import REPO_ROOT


def test_the_model_fits_board_v3_and_its_noise_is_v3s():
    model = bm.fit_board(REPO_ROOT / "leaderboard" / "records")
    assert len(model.groups) == 4
    for group in model.groups.values():
        assert 0.1 < group.sigma_test < 0.5 and 0.1 < group.sigma_val < 0.5
        assert set(group.methods) >= {"dpsgd", "rs", "nasr", "bgep"}
        assert group.methods["nasr"]["own_space"] and not group.methods["rs"]["own_space"]
        for m in group.methods.values():
            assert all(np.isfinite([m["a"], m["s"], m["tau"]])) and m["tau"] >= 0
            assert np.isfinite(m["trial0"]).all()  # a recipe may sit outside the space
        assert group.methods["bgep"]["a"] < -1  # v3: B-GEP is worse in every group
    assert model.as_json()  # plain JSON


def test_a_simulated_arm_is_a_search_on_a_test_set_of_10000():
    rng = np.random.default_rng()
    group = bm.fit_board(REPO_ROOT / "leaderboard" / "records").groups[
        "fashion_mnist__tanh_cnn__eps3.0__delta1e-05"]
    points = group.space.draw(17, rng)
    assert points.shape == (17, 5) and ((points[:, :2] >= 0) & (points[:, :2] < 1)).all()
    assert set(np.unique(points[:, 2:])) <= {0.0, 1.0, 2.0}
    arm = bm.simulate_arm(group, "rs", group.baseline(points, rng), 3, rng)
    assert arm["winner"] == int(np.argmax(arm["val"])) and len(arm["retrains"]) == 3
    assert np.allclose(arm["test"] * 100, np.round(arm["test"] * 100), atol=1e-6)
    clone = bm.simulate_arm(group, "rs", np.full(17, 80.0), 2, rng, heterogeneous=False,
                            shift=1.0)
    assert np.allclose(clone["mu"], 81.0)
