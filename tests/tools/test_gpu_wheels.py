"""tools/gpu_wheels.py without the network: what it asks pip to resolve, the stand-in wheels of the image's torch
and triton, and which of the resolution's wheels a lent machine gets."""

from __future__ import annotations

import zipfile


def test_the_requirements_are_moe_scales_own_and_the_image_pins_torch_and_triton(load_tool):
    wheels = load_tool("gpu_wheels")
    reqs = wheels.requirements()
    assert any(r.startswith("deepspeed") for r in reqs) and any(r.startswith("datasets") for r in reqs)
    assert any(r.startswith("pytest") for r in reqs)   # the test extra: tests/gpu runs there
    image = wheels.image_packages()
    assert image["torch"] == "2.11.0" and image["triton"] == "3.6.0"
    assert "pyarrow" in image and image["pyarrow"] is None and "deepspeed" not in image and "datasets" not in image


def test_a_stand_in_wheel_names_the_image_build_and_needs_nothing(load_tool, tmp_path):
    load_tool("gpu_wheels").stub_wheel("torch", "2.11.0", tmp_path)
    (wheel,) = tmp_path.glob("*.whl")
    assert wheel.name == "torch-2.11.0+image-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as z:
        metadata = z.read("torch-2.11.0+image.dist-info/METADATA").decode()
        assert z.namelist()[-1] == "torch-2.11.0+image.dist-info/RECORD"
    assert "Version: 2.11.0+image" in metadata and "Requires-Dist" not in metadata


def test_the_machine_gets_what_its_image_lacks_and_small_pure_wheels_of_unknown_version(load_tool, tmp_path):
    wheels = load_tool("gpu_wheels")
    files = {"deepspeed": ("deepspeed-0.19.8-py3-none-any.whl", 2 << 20),              # not in the image
             "pydantic-core": ("pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.whl", 2 << 20),
             "fsspec": ("fsspec-2026.9.0-py3-none-any.whl", 200 << 10),                  # small, pure, version unknown
             "huggingface-hub": ("huggingface_hub-1.33.0-py3-none-any.whl", 600 << 10),  # pinned in the image
             "pyarrow": ("pyarrow-26.0.1-cp312-cp312-manylinux_2_28_x86_64.whl", 40 << 20),   # binary, image has it
             "tensorboard": ("tensorboard-2.21.0-py3-none-any.whl", 5 << 20)}             # pure but large
    paths = {}
    for name, (file, size) in files.items():
        paths[name] = tmp_path / file
        paths[name].write_bytes(b"\0" * size)
    image = {"fsspec": None, "huggingface-hub": "1.33.0", "pyarrow": None, "tensorboard": None}
    assert wheels.select(paths, image, full=False) == {
        "deepspeed-0.19.8-py3-none-any.whl": "not in the image",
        "fsspec-2026.9.0-py3-none-any.whl": "small, pure Python; its version in the image is not known",
        "pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.whl": "not in the image"}
    assert set(wheels.select(paths, image, full=True)) == {file for file, _ in files.values()}
