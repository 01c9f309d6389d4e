"""LTX-2 against Lightricks' own implementation (ltx-core / ltx-pipelines 1.0.0; ``pip install .[ltx-official]``
plus ``pip install --no-deps ltx-core==1.0.0 ltx-pipelines==1.0.0``).

The same tiny random weights on both sides: ltx-core's modules write them in the official single-file layout and
ltx-core's loader reads them back; diffusers' converters turn the same tensors into the classes omnispec loads.
Gemma is shared (the same module and tokenizer files on both sides), so prompts go through both text stacks. A
test pins each difference between the two (BENCHMARKS.md, "LTX-2 against the official implementation")."""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

import omnispec
from omnispec.spec import flow_match_sigmas, load_spec
from omnispec.testing import ltx_converted as lc
from omnispec.testing import ltx_official as lo
from omnispec.testing import video_metrics as vm
from omnispec.testing.ltx2_fixtures import ltx2_components

pytest.importorskip("ltx_core")
lo.import_ltx()  # ltx-core's audio package, without torchaudio
pytest.importorskip("ltx_pipelines")

from conftest import SPECS

SIZE = {"height": 64, "width": 96, "frames": 9, "fps": 25.0}  # latents 2 x 2 x 3 (12 tokens), 9 audio frames
STEPS, SEED, SIGMA = 4, 3, 0.7
PROMPT, NEGATIVE = "a robot dancing", "blurry"
SPEC = {"2.0": "ltx2-t2v.yaml", "2.3": "ltx2.3-t2v.yaml"}
COSINE = 0.999  # one forward, float32


@dataclass
class Pair:
    version: str
    official: lo.OfficialModels
    converted: dict  # diffusers modules as diffusers' converters and converter configs give them
    root: Path  # the LTX2Pipeline directory omnispec loads


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    built = {}

    def get(version: str) -> Pair:
        if version not in built:
            work = tmp_path_factory.mktemp(f"ltx{version}-official")
            state = lo.official_checkpoint(work / "official.safetensors", version)
            converted = lc.diffusers_components(state, version)
            saved = dict(converted)
            if version == "2.3":  # as ltx-core runs it: see test_ltx23_official_vocoder_clamps_its_16khz_stage
                saved["vocoder"] = _with_config(converted["vocoder"], final_act_fn="clamp")
            text = ltx2_components(0, version)
            root = lc.save_diffusers_checkpoint(work / "diffusers", saved, text["text_encoder"], text["tokenizer"])
            official = lo.load_official(work / "official.safetensors", text["text_encoder"], root / "tokenizer")
            built[version] = Pair(version, official, converted, root)
        return built[version]

    return get


def _with_config(module, **changes):
    rebuilt = type(module).from_config({**module.config, **changes}).eval()
    rebuilt.load_state_dict(module.state_dict())
    return rebuilt


def _latents(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    (_, c, f, h, w), (_, ca, length, mel) = lo.latent_sizes(**SIZE)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, f * h * w, c, generator=generator), torch.randn(1, length, ca * mel, generator=generator)


def _guider(cfg: float, stg: float):
    from ltx_core.components.guiders import MultiModalGuiderParams

    return MultiModalGuiderParams(cfg_scale=cfg, stg_scale=stg, rescale_scale=0.7, modality_scale=3.0, skip_step=0,
                                  stg_blocks=[1])


# ---- the text stack and one transformer forward -------------------------------------------------------------


@pytest.mark.parametrize("version", lo.VERSIONS)
def test_prompt_encoding_matches_official(pair, version):
    from diffusers.pipelines.ltx2 import LTX2Pipeline

    p = pair(version)
    official = p.official.encode(PROMPT)
    helper = LTX2Pipeline.from_pretrained(str(p.root))
    embeds, mask, _, _ = helper.encode_prompt([PROMPT], do_classifier_free_guidance=False,
                                              max_sequence_length=lo.SEQUENCE, device=lo.CPU)
    video, audio, _ = helper.connectors(embeds, mask, padding_side=helper.tokenizer.padding_side)
    assert vm.cosine(video, official.video_encoding) >= COSINE
    assert vm.cosine(audio, official.audio_encoding) >= COSINE


@pytest.mark.parametrize("kind", lo.PASSES)
@pytest.mark.parametrize("version", lo.VERSIONS)
def test_transformer_forward_matches_official(pair, version, kind):
    if version == "2.0" and kind == "stg":
        pytest.skip("diffusers' LTX-2.0 config ignores STG: test_ltx20_stg_is_a_no_op_in_diffusers_ltx20_config")
    p = pair(version)
    video, audio = _latents()
    context = p.official.encode(PROMPT)
    ours = lc.diffusers_forward(p.converted["transformer"], video, audio, context, SIGMA, kind=kind, **SIZE)
    official = lo.official_forward(p.official, video, audio, context, SIGMA, kind=kind, **SIZE)
    assert vm.cosine(ours[0], official[0]) >= COSINE and vm.cosine(ours[1], official[1]) >= COSINE


# ---- the one-stage run -------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", lo.VERSIONS)
def test_one_stage_run_meets_the_official_guard(pair, version):
    """ltx-pipelines' one-stage loop against ``omnispec.build(<bundled spec>)`` on the same weights, prompts and
    initial noise: CFG 3 / 7, STG 1 / 1 (LTX-2.3 only), modality 3 / 3, rescale 0.7 / 0.7, 4 steps."""
    p = pair(version)
    stg = 1.0 if version == "2.3" else 0.0  # LTX-2.0: test_ltx20_stg_is_a_no_op_in_diffusers_ltx20_config
    noise = lc.diffusers_noise(SEED, *lo.latent_sizes(**SIZE))  # test_the_official_noiser_lays_a_seed_out_otherwise
    official = lo.official_one_stage(p.official, PROMPT, NEGATIVE, steps=STEPS, video_guidance=_guider(3.0, stg),
                                     audio_guidance=_guider(7.0, stg), noise=noise, **SIZE)
    pipe = omnispec.build(SPECS / SPEC[version], source=str(p.root), overrides=[
        "model.dtype=float32", f"recipe.defaults.height={SIZE['height']}", f"recipe.defaults.width={SIZE['width']}",
        f"recipe.defaults.frames={SIZE['frames']}", f"recipe.defaults.fps={int(SIZE['fps'])}",
        f"recipe.defaults.steps={STEPS}", f"recipe.defaults.max_sequence_length={lo.SEQUENCE}",
        "recipe.phases.0.guidance.terms.1.layers=[1]", f"recipe.phases.0.guidance.terms.1.scale={stg}",
        # ltx-pipelines shifts for 4096 tokens whatever the size: test_bundled_schedule_equals_official_only_at_4096
        "recipe.phases.0.schedule.base_shift=2.05", "model.check_checkpoint=false", "runtime.progress=false"])
    ours = pipe(PROMPT, seed=SEED, negative_prompt=NEGATIVE)

    frames, reference = ours.array[0] * 255.0, official.frames.astype(np.float64)  # theirs: uint8, truncated
    ssim = vm.ssim_per_frame(frames, reference)
    metrics = {"video_latent_cosine": vm.cosine(ours.latents["video"], official.video_latent.flatten(2).transpose(1, 2)),
               "audio_latent_cosine": vm.cosine(ours.latents["audio"], official.audio_latent.transpose(1, 2).flatten(2)),
               "ssim_mean": float(ssim.mean()), "ssim_min": float(ssim.min()), "psnr": vm.psnr(frames, reference),
               "audio_relative_l2": vm.relative_l2(ours.audio[0], official.audio)}
    print(f"\nLTX-{version} one stage against ltx-pipelines:", {k: round(v, 6) for k, v in metrics.items()})
    assert ours.sample_rate == official.sample_rate and ours.audio[0].shape == official.audio.shape
    assert metrics["video_latent_cosine"] >= COSINE and metrics["audio_latent_cosine"] >= COSINE
    assert metrics["ssim_mean"] >= 0.95 and metrics["ssim_min"] >= 0.90 and metrics["psnr"] >= 30.0
    assert metrics["audio_relative_l2"] <= 0.2


# ---- the differences, one test each ----------------------------------------------------------------------------


def test_bundled_schedule_equals_official_only_at_4096_video_tokens():
    """ltx-pipelines' one- and two-stage pipelines call ``LTX2Scheduler().execute(steps)`` without the latent, so
    its shift is the one for 4096 tokens (mu 2.05) at every size; diffusers (and the bundled specs) interpolate mu
    from the video token count. Pinning base_shift to max_shift (2.05) gives the official schedule."""
    from ltx_core.components.schedulers import LTX2Scheduler

    schedule = load_spec(SPECS / "ltx2-t2v.yaml").recipe.phases[0].schedule
    official = LTX2Scheduler().execute(steps=30)

    def gap(schedule, tokens: int) -> float:
        return float((torch.tensor(flow_match_sigmas(schedule, 30, tokens)) - official).abs().max())

    assert gap(schedule, 4096) < 1e-6
    assert gap(schedule, 16 * 24 * 16) > 0.1  # the default 512 x 768 x 121: mu 2.78 against 2.05
    pinned = schedule.model_copy(update={"base_shift": 2.05})
    assert gap(pinned, 18) < 1e-6 and gap(pinned, 16 * 24 * 16) < 1e-6


def test_the_official_noiser_lays_a_seed_out_otherwise():
    """ltx-core's GaussianNoiser draws the noise in token layout (1, T, C), diffusers (and omnispec) draw
    (1, C, F, H, W) and pack it: the same seed gives other noise, so the one-stage test hands both the same."""
    from ltx_core.components.noisers import GaussianNoiser
    from ltx_core.types import VideoPixelShape
    from ltx_pipelines.utils.helpers import noise_video_state
    from ltx_pipelines.utils.types import PipelineComponents

    pixels = VideoPixelShape(batch=1, **SIZE)
    state, _ = noise_video_state(pixels, GaussianNoiser(torch.Generator("cpu").manual_seed(SEED)), [],
                                 PipelineComponents(dtype=torch.float32, device=lo.CPU), torch.float32, lo.CPU)
    ours = lc.diffusers_noise(SEED, *lo.latent_sizes(**SIZE))[0]
    assert state.latent.shape == ours.shape
    assert torch.equal(state.latent, torch.randn(ours.shape, generator=torch.Generator().manual_seed(SEED)))
    assert not torch.allclose(state.latent, ours)


def test_ltx20_stg_is_a_no_op_in_diffusers_ltx20_config(pair):
    """ltx-core skips the self-attention of the STG blocks for every checkpoint; diffusers' LTX-2.0 transformer
    config (perturbed_attn false) keeps the plain attention processor, so its STG pass equals the plain pass.
    The same weights with perturbed_attn true follow the official STG pass."""
    p = pair("2.0")
    video, audio = _latents()
    context = p.official.encode(PROMPT)

    def forwards(fn, model):
        return [fn(model, video, audio, context, SIGMA, kind=kind, **SIZE) for kind in ("plain", "stg")]

    (plain, stg), (ours_plain, ours_stg) = forwards(lo.official_forward, p.official), forwards(
        lc.diffusers_forward, p.converted["transformer"])
    assert vm.cosine(stg[0], plain[0]) < 0.99  # the official STG pass moves the prediction
    assert torch.equal(ours_stg[0], ours_plain[0]) and torch.equal(ours_stg[1], ours_plain[1])
    perturbable = _with_config(p.converted["transformer"], perturbed_attn=True)
    fixed = lc.diffusers_forward(perturbable, video, audio, context, SIGMA, kind="stg", **SIZE)
    assert vm.cosine(fixed[0], stg[0]) >= COSINE and vm.cosine(fixed[1], stg[1]) >= COSINE


def test_ltx23_official_vocoder_clamps_its_16khz_stage(pair):
    """ltx-core builds LTX-2.3's first vocoder with its final activation on (clamp to [-1, 1] when
    ``use_tanh_at_final`` is false) before the bandwidth extension; diffusers' converter writes
    ``final_act_fn: null`` for it, so a waveform past +-1 reaches the BWE unclipped."""
    p = pair("2.3")
    latent = torch.randn(1, 8, 9, 16, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        mel = p.official.audio_decoder(latent)
        official = p.official.vocoder(mel)
        assert p.converted["vocoder"].vocoder(mel).abs().max() > 1  # random weights: past the clamp
        assert vm.relative_l2(p.converted["vocoder"](mel), official) > 0.2
        clamped = _with_config(p.converted["vocoder"], final_act_fn="clamp")
        assert vm.relative_l2(clamped(mel), official) < 1e-5
