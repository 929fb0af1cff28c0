"""`Sampler.index_batches`: the one cut of each step's draw into physical
batches, read by the trainer's pipeline and Keras fit's arrays alike."""

import numpy as np
import tensorflow as tf

from tfdp import samplers

KEY = np.array([5, 9], np.int64)


def _batches(sampler, steps, **kwargs):
    ds = sampler.index_batches(KEY, tf.data.Dataset.range(*steps), **kwargs)
    return [{k: np.asarray(v) for k, v in b.items()} for b in ds]


class IndexBatchesTest(tf.test.TestCase):

    def _check_cut(self, sampler, steps, granule=None, host=0):
        batches = _batches(sampler, steps, granule=granule, host=host)
        p = sampler.physical_batch_size
        for step in range(*steps):
            mine = [b for b in batches if b["step"] == step]
            self.assertNotEmpty(mine)
            indices, weights = sampler.step_indices(KEY, tf.constant(step, tf.int64), host,
                                                    granule=granule)
            self.assertAllEqual(np.concatenate([b["indices"] for b in mine]), indices)
            self.assertAllEqual(np.concatenate([b["weights"] for b in mine]), weights)
            self.assertEqual([b["last"] for b in mine], [False] * (len(mine) - 1) + [True])
            self.assertEqual([b["start"] for b in mine], [i * p for i in range(len(mine))])
            self.assertTrue(all(b["step_rows"] == len(indices) for b in mine))
            self.assertTrue(all(len(b["indices"]) == p for b in mine[:-1]))
            self.assertBetween(len(mine[-1]["indices"]), 1, p)
        # Steps come in order and never interleave.
        order = [int(b["step"]) for b in batches]
        self.assertEqual(order, sorted(order))

    def test_each_sampler_cuts_its_draw(self):
        for name in ("poisson", "shuffle", "banded_poisson"):
            extra = {"bands": 2} if name == "banded_poisson" else {}
            sampler = samplers.make_sampler(name, dataset_size=300, logical_batch_size=32,
                                            physical_batch_size=8, **extra)
            with self.subTest(name):
                self._check_cut(sampler, (2, 7))

    def test_a_granule_shortens_only_the_last_batch(self):
        sampler = samplers.make_sampler("poisson", dataset_size=300, logical_batch_size=32,
                                        physical_batch_size=8)
        self._check_cut(sampler, (0, 6), granule=2)
        lengths = [len(b["indices"]) for b in _batches(sampler, (0, 6), granule=2)]
        self.assertTrue(any(n % 8 for n in lengths))  # Some step ended short.

    def test_hosts_share_each_step(self):
        sampler = samplers.make_sampler("poisson", dataset_size=300, logical_batch_size=32,
                                        physical_batch_size=8).with_hosts(2, 4)
        for host in (0, 1):
            self._check_cut(sampler, (0, 4), host=host)

    def test_ordered_follows_the_data_and_only_for_fixed_steps(self):
        sampler = samplers.make_sampler("shuffle", dataset_size=100, logical_batch_size=20,
                                        physical_batch_size=10)
        batches = _batches(sampler, (5, 7), ordered=True)
        # Step 5 is the first of pass 1 (5 steps a pass): rows 0..19.
        self.assertAllEqual(np.concatenate([b["indices"] for b in batches[:2]]), np.arange(20))
        poisson = samplers.make_sampler("poisson", dataset_size=100, logical_batch_size=20,
                                        physical_batch_size=10)
        with self.assertRaisesRegex(ValueError, "no data order"):
            _batches(poisson, (0, 1), ordered=True)
