#!/usr/bin/env bash
# Everything the scripts need on a fresh Debian/Ubuntu machine: system packages (the Vulkan loader and driver for
# ManiSkill3, EGL for MuJoCo's videos), then Python packages (requirements.txt); with --dev also what the tests and
# CI's checks use (requirements-dev.txt). Safe to run again; prints what it does.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/install_system.sh
bash .ci/install_python.sh "$@"
