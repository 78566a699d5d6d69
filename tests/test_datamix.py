import numpy as np
import pytest

from knapformer.planning.datamix import DataCode, mix_gpus, parse_mix, sample_lengths, scale_mix


def test_data_code_tokens():
    image = DataCode.parse("g4b5i1024f1s0")
    assert (image.gpus, image.batch, image.visual_tokens) == (4, 5, 64 * 64)
    video = DataCode.parse("g8b2i256f85s1")
    assert video.latent_frames == 25  # int(85 / 3.4)
    assert video.visual_tokens == 25 * 256


def test_named_mixes_cover_32_gpus_and_scale():
    for name in ("lowres", "mixres", "joint", "video", "seqheavy"):
        assert mix_gpus(parse_mix(name)) == 32
        assert mix_gpus(scale_mix(parse_mix(name), 32)) == 1024


def test_the_sequence_heavy_mix_piles_hundreds_of_sequences_on_one_gpu():
    lengths = sample_lengths(parse_mix("seqheavy"), np.random.default_rng(0))
    counts = [len(x) for x in lengths]
    assert counts[0] == 384 and max(counts[1:]) <= 4 and sum(counts) == 490
    # 64-px samples are mostly prompt: 16 visual tokens plus 0..392 of text
    assert lengths[0].min() >= 15 and lengths[0].max() <= 16 * 1.04 + 392


def test_sample_lengths_follow_the_codes():
    codes = parse_mix("g2b3i512f1s0,g1b1i256f85s1")
    lengths = sample_lengths(codes, np.random.default_rng(0))
    assert [len(x) for x in lengths] == [3, 3, 1]
    image = np.concatenate(lengths[:2])
    # visual tokens 1024 scaled by [0.96, 1.04], plus 0..392 text tokens
    assert image.min() >= int(1024 * 0.96) and image.max() <= int(1024 * 1.04) + 392
    assert int(25 * 256 * 0.96) <= lengths[2][0] <= int(25 * 256 * 1.04) + 392


def test_bad_codes_are_named():
    with pytest.raises(ValueError, match="g2b3"):
        parse_mix("g2b3")
