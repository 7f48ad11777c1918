"""Builds the compiled backends of vcpo_kernels (the C++ CPU op; see docs/contract.md)."""
import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = os.path.dirname(os.path.abspath(__file__))
# Portable flags: the AVX2 loops are compiled in their own file and chosen at run time (csrc/cpu/dispatch.h).
CXX_FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-std=c++17"]

setup(
    ext_modules=[
        CppExtension(
            name="vcpo_kernels._C",
            sources=["csrc/registration.cpp", "csrc/autograd.cpp", *sorted(glob.glob("csrc/cpu/*.cpp"))],
            include_dirs=[os.path.join(HERE, "csrc", "cpu")],
            extra_compile_args={"cxx": CXX_FLAGS},
            extra_link_args=["-fopenmp"],
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
