#!/usr/bin/env bash
# Everything the scripts and the tests need on a fresh Debian/Ubuntu machine: system packages (the Vulkan loader and
# driver for ManiSkill3), then Python packages (requirements.txt). Safe to run again; prints what it does.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/install_system.sh
bash .ci/install_python.sh
