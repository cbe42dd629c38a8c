"""Packaging for SEAD: the RL engine (`verl`) and the dialogue side (`llm_agent`)."""
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent


def read_requirements(name: str) -> list[str]:
    """Return the requirement lines of a requirements file, without comments or blanks."""
    lines = (ROOT / name).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


setup(
    name="sead",
    version="0.1.0",
    description="SEAD: self-evolving RL training of multi-turn service-dialogue agents (veRL-style engine)",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["verl", "verl.*", "llm_agent", "llm_agent.*"]),
    package_data={"verl": ["trainer/config/*.yaml", "trainer/config/*/*.yaml"],
                  "llm_agent": ["evaluation/report_assets/*"]},
    include_package_data=True,
    install_requires=read_requirements("requirements.txt"),
    extras_require={
        "test": ["pytest>=8", "pytest-timeout>=2.3", "openai>=1.40", "mlflow-skinny>=3.0", "selenium>=4.20",
                 "hypothesis>=6.100,<7", "pytest-xdist>=3.6"],
        "tracking": ["mlflow-skinny>=3.0"],
        "gpu": ["flash-attn>=2.6"],
        "vllm": ["vllm>=0.8"],
    },
)
