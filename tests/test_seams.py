"""Features checked at their seam, in this process: `run.timeout_s` reaches the process group, and
`execution.cache=magcache` builds diffusers' MagCache with the job's step count and changes the images."""

from datetime import timedelta

import numpy as np
import pytest
from conftest import FLUX2_KW

from launcher.config import load_config


def test_run_timeout_s_reaches_the_process_group(monkeypatch):
    import torch.distributed as dist

    from launcher.worker import dist as mesh_dist
    from launcher.worker import runner

    class Stop(Exception):
        pass

    def init(device_type, timeout_s):
        raise Stop(device_type, timeout_s)

    monkeypatch.setattr(runner, "init_distributed", init)
    with pytest.raises(Stop) as stopped:
        runner.run_worker(load_config("tiny", ["run.timeout_s=37"]))
    assert stopped.value.args == ("cpu", 37)
    seen = {}
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: seen.update(kw))
    mesh_dist.init_distributed("cpu", 37)
    assert seen == {"backend": "gloo", "timeout": timedelta(seconds=37)}


def test_magcache_takes_the_jobs_steps_and_changes_the_images(tiny_model):
    import torch
    from diffusers import Flux2Pipeline
    from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

    from launcher.worker.cache import apply_cache, cache_config

    config = cache_config("magcache", {"mag_ratios": "flux"}, 8)
    # diffusers resamples FLUX's 28 calibrated ratios to the job's 8 steps
    assert config.num_inference_steps == 8 and len(config.mag_ratios) == 8 and len(FLUX_MAG_RATIOS) == 28
    assert float(config.mag_ratios[0]) == float(FLUX_MAG_RATIOS[0]) and float(config.mag_ratios[1]) == 1.0625
    assert cache_config("magcache", {"num_inference_steps": 5, "mag_ratios": "flux"}, 8).num_inference_steps == 5

    pipe = Flux2Pipeline.from_pretrained(tiny_model)
    pipe.set_progress_bar_config(disable=True)

    def image():
        return pipe(
            prompt="a red cube",
            generator=torch.Generator("cpu").manual_seed(0),
            height=64,
            width=64,
            num_inference_steps=8,
            output_type="np",
            **FLUX2_KW,
        ).images[0]

    plain = image()
    cfg = load_config(
        "tiny",
        [
            f"model.path={tiny_model}",
            "execution.cache=magcache",
            "generate.num_inference_steps=8",
            "+execution.cache_options.mag_ratios=flux",
            "+execution.cache_options.threshold=0.5",
        ],
    )
    apply_cache(pipe, cfg)
    cached = image()
    assert np.isfinite(cached).all() and not np.array_equal(plain, cached)
