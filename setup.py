import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
VERSION = re.search(r'__version__ = "([^"]+)"', (HERE / "metadispatch" / "__init__.py").read_text()).group(1)

setup(
    name="metadispatch",
    version=VERSION,
    description="Trace every op, shape, stride and device of a PyTorch model without running it; replay the trace for real.",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["metadispatch", "metadispatch.*"]),
    python_requires=">=3.10",
    # numpy: torch warns without it; trace files encode bytes through it.
    # orjson: trace files are JSON, and the standard library's encoder was
    # as slow as everything else in saving together.
    install_requires=["torch>=2.5", "numpy", "orjson>=3.9"],
    extras_require={
        "hf": ["transformers>=4.45"],
        "plot": ["matplotlib"],
        "test": ["pytest>=7", "expecttest>=0.2", "transformers>=4.45", "matplotlib", "hypothesis>=6"],
    },
    entry_points={
        "console_scripts": ["metadispatch = metadispatch.cli.main:main"],
        "pytest11": ["metadispatch = metadispatch.testing.plugin"],
    },
)
