"""Image formats (issue 17): PNG, JPEG and WebP written by real runs, read back by PIL, datasets and webdataset."""

import io
import tarfile

import imagecodecs
import numpy as np
import pyarrow.parquet as pq
from conftest import launch, pixels, read_rows
from PIL import Image

from launcher.config import load_config
from launcher.writer.encode import Encoding, encode

# JPEG's example luminance table (ITU T.81 Annex K, Table K.1), in natural order.
ANNEX_K_LUMA = [
    16, 11, 10, 16, 24, 40, 51, 61, 12, 12, 14, 19, 26, 58, 60, 55, 14, 13, 16, 24, 40, 57, 69, 56,
    14, 17, 22, 29, 51, 87, 80, 62, 18, 22, 37, 56, 68, 109, 103, 77, 24, 35, 55, 64, 81, 104, 113, 92,
    49, 64, 78, 87, 103, 121, 120, 101, 72, 92, 95, 98, 112, 100, 103, 99,
]  # fmt: skip
# The IJG luminance table at quality 95 (Annex K's table scaled by 200 - 2 * 95 = 10 %, rounded, at least 1),
# worked out by hand from the standard; quality 30 would give 27 in the first place.
JPEG_Q95_LUMA = [
    2, 1, 1, 2, 2, 4, 5, 6, 1, 1, 1, 2, 3, 6, 6, 6, 1, 1, 2, 2, 4, 6, 7, 6, 1, 2, 2, 3, 5, 9, 8, 6,
    2, 2, 4, 6, 7, 11, 10, 8, 2, 4, 6, 6, 8, 10, 11, 9, 5, 6, 8, 9, 10, 12, 12, 10, 7, 9, 10, 10, 11, 10, 10, 10,
]  # fmt: skip
# At tp=1 (one worker: a cheaper launch), as the PNG run they are compared with; at a quality other than the
# default (95), so that a quality that never reached the encoder shows.
TP1 = "mesh.tp=1"
JPEG_JOB = (TP1, "output.format=jpeg", "output.quality=40", "output.webdataset=true", "output.row_group_size=3")
JPEG_JOB += ("output.image_files=true",)  # the files too: their names and bytes are checked


def ijg_luma(quality: int) -> list[int]:
    """IJG's luminance table at `quality`: Annex K's scaled by 5000 / q % below 50, by 200 - 2q % from 50, rounded
    half up, within 1..255."""
    scale = 5000 // quality if quality < 50 else 200 - 2 * quality
    return [min(255, max(1, (q * scale + 50) // 100)) for q in ANNEX_K_LUMA]


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(float) - b.astype(float)) ** 2).mean())
    return 10 * np.log10(255**2 / mse) if mse else float("inf")


def test_jpeg_run_writes_jpg_files_parquet_paths_and_webdataset_keys(run_job):
    png, out = read_rows(run_job(TP1)), run_job(*JPEG_JOB)
    rows = read_rows(out)
    assert rows.keys() == png.keys()
    for key, r in rows.items():
        assert r["image"]["path"] == f"{key}.jpg"
        shard = f"shard-{int(key) // 8:05d}"
        assert (out / "images" / shard / f"{key}.jpg").read_bytes() == r["image"]["bytes"]
        image = Image.open(io.BytesIO(r["image"]["bytes"]))
        assert image.format == "JPEG" and image.size == (64, 64)
        # The very image the PNG run holds losslessly (the same seed gives the same pixels), at quality 40: these
        # random-weight images are noise, which JPEG's chroma subsampling blurs, hence a low PSNR bound.
        original = pixels(png[key]["image"]["bytes"]).astype(np.uint8)
        assert r["image"]["bytes"] == imagecodecs.jpeg8_encode(original, level=40)  # libjpeg itself, not encode()
        assert r["image"]["bytes"] != imagecodecs.jpeg8_encode(original, level=95)
        assert image.quantization[0] == ijg_luma(40)  # what quality 40 means, whichever library wrote it
        pil = io.BytesIO()
        Image.fromarray(original).save(pil, format="JPEG", quality=40)
        assert Image.open(pil).quantization == image.quantization  # Pillow at quality 40: the same tables
        assert psnr(pixels(r["image"]["bytes"]), original) > 15
    assert "jpeg (lossy, quality 40)" in (out / "README.md").read_text()  # the card says what was written
    assert not list((out / "images").rglob("*.png"))
    with tarfile.open(out / "webdataset" / "shard-00000.tar") as tar:
        assert tar.getnames() == [f"{i}.{ext}" for i in range(8) for ext in ("jpg", "json")]
    import webdataset as wds

    samples = list(wds.WebDataset(str(out / "webdataset" / "shard-00000.tar"), shardshuffle=False).decode("pil"))
    assert [s["__key__"] for s in samples] == [str(i) for i in range(8)]
    assert isinstance(samples[0]["jpg"], Image.Image) and samples[0]["jpg"].size == (64, 64)


def decoded_by_datasets(out, expected: str) -> None:
    import datasets

    ds = datasets.load_dataset("parquet", data_files=str(out / "data" / "*.parquet"), split="train")
    assert isinstance(ds.features["image"], datasets.Image), expected
    assert len(ds) == 20 and ds[0]["image"].format == expected and ds[0]["image"].size == (64, 64)


def test_datasets_decodes_jpeg_as_images(run_job):
    decoded_by_datasets(run_job(*JPEG_JOB), "JPEG")  # WebP: below, on the lossless run


def test_lossless_webp_keeps_the_pixels_and_the_old_png_key_works(run_job, tiny_model, tmp_path):
    png = read_rows(run_job(TP1))
    out = tmp_path / "out"
    job = [TP1, "output.format=webp", "output.lossless=true", "output.png=true"]  # files, off by default now
    res = launch(f"model.path={tiny_model}", f"output.dir={out}", *job)
    assert res.returncode == 0, res.stderr[-3000:]
    notices = [ln for ln in res.stderr.splitlines() if "output.png is now called output.image_files" in ln]
    assert len(notices) == 1, res.stderr[-3000:]
    files = sorted(p.name for p in (out / "images").rglob("*.*"))  # output.png=true still means image files
    assert files and all(f.endswith(".webp") for f in files)
    rows = read_rows(out)
    for key, r in rows.items():
        assert Image.open(io.BytesIO(r["image"]["bytes"])).format == "WEBP" and r["image"]["path"] == f"{key}.webp"
        assert np.array_equal(pixels(r["image"]["bytes"]), pixels(png[key]["image"]["bytes"])), key
    decoded_by_datasets(out, "WEBP")  # lossy or lossless, one format to a reader


def test_row_groups_hold_a_fixed_number_of_rows(run_job):
    out = run_job(*JPEG_JOB)
    f = pq.ParquetFile(out / "data" / "shard-00000.parquet")
    assert [f.metadata.row_group(i).num_rows for i in range(f.num_row_groups)] == [3, 3, 2]
    group = f.read_row_group(1, columns=["id", "image"])  # one group alone, without the rest of the file
    assert group.column("id").to_pylist() == ["3", "4", "5"]
    assert Image.open(io.BytesIO(group.column("image")[0].as_py()["bytes"])).size == (64, 64)
    assert pq.ParquetFile(out / "data" / "shard-00002.parquet").metadata.num_row_groups == 2  # 4 rows: 3 + 1


def _zlib_level(png: bytes) -> int:
    """FLEVEL of a PNG's zlib stream (RFC 1950): 0 for level 1, 1 for 2-5, 2 for 6, 3 for 7-9."""
    idat = png.index(b"IDAT") + 4
    return png[idat + 1] >> 6


def test_png_encoder_png_level_quality_and_webp_method_reach_the_encoder():
    """The config's encoder choices as written: the same bytes as the named library called with them."""
    px = np.random.default_rng(0).integers(0, 256, (32, 48, 3), dtype=np.uint8)

    def enc(*overrides):
        return Encoding.from_config(load_config("tiny", list(overrides)).output)

    assert _zlib_level(encode(px, enc())) == 0  # the default: level 1
    assert _zlib_level(encode(px, enc("output.png_level=9"))) == 3
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, format="PNG", compress_level=6)
    assert encode(px, enc("output.png_encoder=pil", "output.png_level=6")) == buf.getvalue()
    assert encode(px, enc("output.png_level=6")) == bytes(imagecodecs.png_encode(px, level=6))
    assert encode(px, enc("output.png_level=6")) != buf.getvalue()  # so the two encoders are told apart
    webp = {m: encode(px, enc("output.format=webp", f"output.webp_method={m}")) for m in (0, 4)}
    assert webp[4] == bytes(imagecodecs.webp_encode(px, level=95, lossless=False, method=4)) != webp[0]
    assert ijg_luma(95) == JPEG_Q95_LUMA  # the formula against the table worked out by hand
    for fmt, library_encode in (("jpeg", imagecodecs.jpeg8_encode), ("webp", imagecodecs.webp_encode)):
        lossy = {q: encode(px, enc(f"output.format={fmt}", f"output.quality={q}")) for q in (40, 95)}
        kw = {"lossless": False, "method": 0} if fmt == "webp" else {}
        assert lossy[40] == bytes(library_encode(px, level=40, **kw)) != lossy[95], fmt
        assert encode(px, enc(f"output.format={fmt}")) == lossy[95], fmt  # the default: 95
        assert len(lossy[40]) < len(lossy[95]), fmt
    assert Image.open(io.BytesIO(encode(px, enc("output.format=jpeg", "output.quality=40")))).quantization[0] == (
        ijg_luma(40)
    )
