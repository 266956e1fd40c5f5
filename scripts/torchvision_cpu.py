"""Lets the CUDA build of torchvision import beside the CPU build of torch.

vLLM's vision-language models need torchvision (vLLM 0.32 `model_executor/models/qwen2_vl.py`
imports transformers' `Qwen2VLImageProcessor`, which imports `torchvision.transforms.v2`), and the
only torchvision wheels for torch 2.13 on PyPI are CUDA builds. Their compiled ops (`_C.so`) need
CUDA's libraries, so they do not load; torchvision then still imports `_meta_registrations`, which
registers shapes for those ops and fails: "operator torchvision::nms does not exist". Everything a
vision-language model needs of torchvision is Python and torch (resizing and normalising images).

This module, installed into the environment's site-packages with a `.pth` line that imports it at
start-up (`python scripts/torchvision_cpu.py install`, which `make install` runs on the CPU stack),
declares the schemas of torchvision's ops right after `torchvision.extension` has tried and failed
to load them, so the rest of torchvision imports. Calling one of those ops (nms, roi_align, ...)
still fails, saying it has no CPU kernel. It does nothing where the ops loaded (a matching build),
and imports nothing at start-up but the standard library: torch is imported only when torchvision is.
"""

import importlib.abc
import importlib.machinery
import sys

MODULE = "conveyor_torchvision_cpu"
# torchvision 0.28's ops, as `_meta_registrations.py` and `_autograd_registrations.py` name them
SCHEMAS = (
    "roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio, bool aligned) -> Tensor",
    "_roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "SymInt batch_size, SymInt channels, SymInt height, SymInt width, int sampling_ratio, bool aligned) -> Tensor",
    "ps_roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio) -> (Tensor, Tensor)",
    "_ps_roi_align_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, int sampling_ratio, SymInt batch_size, SymInt channels, "
    "SymInt height, SymInt width) -> Tensor",
    "roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) "
    "-> (Tensor, Tensor)",
    "_roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width) -> Tensor",
    "ps_roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) "
    "-> (Tensor, Tensor)",
    "_ps_roi_pool_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, "
    "SymInt width) -> Tensor",
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qroi_align(Tensor input, Tensor rois, float input_scale, int input_zero_point, float rois_scale, "
    "int rois_zero_point, float spatial_scale, SymInt pooled_height, SymInt pooled_width, int sampling_ratio, "
    "bool aligned) -> Tensor",
    "deform_conv2d(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, SymInt stride_h, "
    "SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, SymInt groups, "
    "SymInt offset_groups, bool use_mask) -> Tensor",
    "_deform_conv2d_backward(Tensor grad, Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, "
    "SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, "
    "SymInt groups, SymInt offset_groups, bool use_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
_library = None  # kept: a Library that is garbage-collected takes its definitions with it


def declare(extension) -> None:
    """Declare the ops' schemas unless `extension` (torchvision.extension) loaded them."""
    global _library
    if extension._has_ops() or _library is not None:
        return
    import torch

    try:  # (declared already, by another copy of this module)
        torch.ops.torchvision.nms.default
        return
    except (AttributeError, RuntimeError):
        pass

    _library = torch.library.Library("torchvision", "DEF")
    for schema in SCHEMAS:
        _library.define(schema)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        declare(module)


class _Finder(importlib.abc.MetaPathFinder):
    conveyor_torchvision_cpu = True

    def find_spec(self, name, path, target=None):
        if name != "torchvision.extension":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> str:
    """Copy this file into site-packages as MODULE and add the .pth line that imports it."""
    import shutil
    import sysconfig
    from pathlib import Path

    site = Path(sysconfig.get_paths()["purelib"])
    shutil.copyfile(__file__, site / f"{MODULE}.py")
    (site / f"{MODULE}.pth").write_text(f"import {MODULE}\n")
    return str(site)


if __name__ == "__main__":
    if sys.argv[1:] != ["install"]:
        sys.exit(f"usage: {sys.argv[0]} install")
    print(f"installed {MODULE} into {install()}")
elif not any(getattr(f, "conveyor_torchvision_cpu", False) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
