"""buffer_reuse.py: which temporaries an output's buffer holds before the output is made, as XLA's buffer
assignment places them (largest first, one at a time per buffer, no larger than it, gone before it is made)."""
import numpy as np
import pytest

from gshard_jax.partitioner.costs.buffer_reuse import held_in_outputs, less_held

CASES = [  # (items: (bytes, first, last), outputs: (bytes, made at), the items held)
    ([(4, 0, 2)], [(4, 3)], [0]),  # fits, gone before the output is made
    ([(4, 0, 3)], [(4, 3)], []),  # still read where the output is made
    ([(8, 0, 1)], [(4, 3)], []),  # larger than the buffer
    ([(2, 0, 1), (4, 0, 1)], [(4, 3)], [1]),  # alive at once: the larger takes the one buffer
    ([(2, 0, 1), (4, 2, 2)], [(4, 3)], [0, 1]),  # one after the other in the same buffer
    ([(2, 0, 1), (4, 0, 1)], [(4, 3), (2, 3)], [0, 1]),  # each in the smallest buffer it fits
    ([(4, 0, 1)], [], []),  # no fresh outputs: nothing held
]


@pytest.mark.parametrize("items, outputs, held", CASES)
def test_an_output_buffer_holds_what_xla_places_in_it(items, outputs, held):
    assert sorted(held_in_outputs(items, outputs)) == held


def test_the_bytes_held_are_taken_off_where_they_are_alive():
    at = np.array([6.0, 6.0, 4.0, 0.0])
    got, held = less_held(at, [(2, 0, 1), (4, 0, 2)], [(4, 3)])
    assert held == {1} and got.tolist() == [2.0, 2.0, 0.0, 0.0]
