"""Builds the compiled backends of vcpo_kernels (docs/contract.md) against the installed torch: the C++ CPU ops
always, and their CUDA kernels (csrc/cuda/) too when that torch is a CUDA build and nvcc is found (CUDA_HOME), or
when VCPO_BUILD_CUDA=1 (then a missing toolkit is an error); VCPO_BUILD_CUDA=0 builds the CPU ops alone."""
import glob
import os

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

HERE = os.path.dirname(os.path.abspath(__file__))
# Portable flags: the AVX2 loops are compiled in their own file and chosen at run time (csrc/cpu/dispatch.h).
CXX_FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-std=c++17"]
NVCC_FLAGS = ["-O3", "-std=c++17", "-lineinfo"]
SOURCES = ["csrc/registration.cpp", "csrc/autograd.cpp", *sorted(glob.glob("csrc/cpu/*.cpp"))]


def _build_cuda() -> bool:
    wanted = os.environ.get("VCPO_BUILD_CUDA")
    possible = torch.version.cuda is not None and CUDA_HOME is not None
    if wanted == "1" and not possible:
        raise RuntimeError(f"VCPO_BUILD_CUDA=1 needs a CUDA build of torch (found {torch.__version__}) and the CUDA "
                           f"toolkit (CUDA_HOME: {CUDA_HOME})")
    return possible if wanted is None else wanted == "1"


def _cuda_include_dirs() -> list:
    # pip's CUDA wheels keep the runtime headers under site-packages/nvidia/cu*/include
    nvidia = os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "nvidia")
    return sorted(glob.glob(os.path.join(nvidia, "cu*", "include")))


if _build_cuda():
    extension = CUDAExtension(
        name="vcpo_kernels._C",
        sources=SOURCES + sorted(glob.glob("csrc/cuda/*.cu")),
        include_dirs=[os.path.join(HERE, "csrc"), os.path.join(HERE, "csrc", "cpu")] + _cuda_include_dirs(),
        extra_compile_args={"cxx": CXX_FLAGS, "nvcc": NVCC_FLAGS},
        extra_link_args=["-fopenmp"],
    )
else:
    extension = CppExtension(
        name="vcpo_kernels._C",
        sources=SOURCES,
        include_dirs=[os.path.join(HERE, "csrc"), os.path.join(HERE, "csrc", "cpu")],
        extra_compile_args={"cxx": CXX_FLAGS},
        extra_link_args=["-fopenmp"],
    )

class BuildWithTorchVersion(BuildExtension):
    """Writes, beside the built extension, the torch it was compiled against: vcpo_kernels refuses to load the
    extension beside another one (vcpo_kernels/cpu/__init__.py), whose C++ symbols would not match."""

    def run(self):
        super().run()
        path = os.path.join(os.path.dirname(self.get_ext_fullpath(extension.name)), "_build.py")
        with open(path, "w") as f:
            f.write(f'"""Written by setup.py at build time."""\nTORCH_VERSION = {torch.__version__!r}\n')


setup(ext_modules=[extension], cmdclass={"build_ext": BuildWithTorchVersion})
