"""The batch-sum sensitivity of every per-example pipeline stays within its declared bound.

Measured on the compiled step with noise 0 and plain SGD (lr 1), so the parameter change is
sum / B: adding one adversarially large example to a batch may move it by at most C / B.
"""

import jax
import numpy as np
import pytest

from dpbench import stages
from tests.conftest import compile_small, make_batch, random_data

N = 32
C = 0.5


def _pipeline(name, l2_bound=C):
    middle = {
        "dpsgd": [],
        "rs": [stages.sparsify.random_mask(final_rate=0.7)],
        "drop_random": [stages.drop.gradients(rate=0.6, criterion="random")],
        "drop_magnitude": [stages.drop.gradients(rate=0.6, criterion="magnitude")],
        "nasr": [stages.nasr.discretize(threshold=1e-3)],
        "prune_random_drop": [stages.prune.random(sparsity=0.5),
                              stages.drop.gradients(rate=0.3, criterion="magnitude")],
    }[name]
    return [stages.grad.per_example(), *middle, stages.clip.global_l2(l2_bound),
            stages.noise.gaussian(),
            stages.optimize.optax_optimizer(optimizer="sgd", learning_rate=1.0)]


def _largest_move(stage_list, scales=(1e2, 1e4, -1e6)):
    compiled, init_params, _ = compile_small(stage_list, n=N, batch_size=N, micro=8,
                                             noise_multiplier=0.0, padded_batch_size=N,
                                             model_name="mlp")
    images, labels = random_data(N)
    params = init_params(jax.random.key(0))
    b = compiled.sampler.sample(0)
    victim = int(np.random.default_rng().integers(N))

    def params_after(imgs, mask):
        state, _ = compiled.step(compiled.init_state(params, jax.random.key(4)),
                                 make_batch(compiled, imgs, labels, b.indices, mask))
        return np.concatenate([np.ravel(np.asarray(a)) for a in jax.tree.leaves(state.params)])

    without = b.mask.copy()
    without[victim] = False  # the add/remove neighbour: the victim example absent
    base = params_after(images, without)
    moves = []
    for scale in scales:
        neighbour = images.copy()
        neighbour[b.indices[victim]] = scale * np.sign(
            np.random.default_rng().normal(size=images[0].shape))
        moves.append(np.linalg.norm(params_after(neighbour, b.mask) - base))
    return max(moves)


@pytest.mark.parametrize("name", ["dpsgd", "rs", "drop_random", "drop_magnitude",
                                  "prune_random_drop", "nasr"])
def test_adding_one_huge_example_moves_the_sum_by_at_most_c(name):
    assert _largest_move(_pipeline(name)) <= C / N * (1 + 1e-5)


def test_the_check_fails_without_clipping():
    assert _largest_move(_pipeline("rs", l2_bound=float("inf"))) > C / N
