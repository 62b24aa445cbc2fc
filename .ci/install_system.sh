#!/usr/bin/env bash
# System packages: the Vulkan loader and a Vulkan driver, which ManiSkill3 (SAPIEN) needs even for state-only
# simulation, and EGL, with which MuJoCo renders videos headless (--capture-video). With an NVIDIA driver (nvidia-smi
# found), the driver brings its own Vulkan and EGL drivers: only the loaders are installed. Without one, the drivers
# are Mesa's software ones (lavapipe for Vulkan, llvmpipe for EGL); SAPIEN needs Mesa >= 24.3, which Debian 12
# (bookworm) has in bookworm-backports, Debian 13 and Ubuntu >= 25.04 in their main archives. Ubuntu 22.04 and 24.04
# ship older Mesa: this script stops there and says so. Safe to run twice; prints what it does.
set -euo pipefail

SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
MESA_MIN=24.3

mesa_version() {
  dpkg-query -W -f='${Version}' mesa-vulkan-drivers 2>/dev/null || echo 0
}

if ! command -v apt-get >/dev/null 2>&1; then
  echo "[install_system] no apt-get: install by hand a Vulkan loader and driver (your GPU's, or Mesa >= $MESA_MIN" \
    "lavapipe) and EGL (libEGL)" >&2
  exit 1
fi

if command -v nvidia-smi >/dev/null 2>&1; then
  echo "[install_system] NVIDIA driver found: its Vulkan and EGL drivers are used; installing the loaders"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q libvulkan1 libegl1
  echo "[install_system] done"
  exit 0
fi

packages="mesa-vulkan-drivers libvulkan1 libegl1 libegl-mesa0 libgl1-mesa-dri"
if ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1 && dpkg --compare-versions "$(mesa_version)" ge "$MESA_MIN" \
  && dpkg-query -W libvulkan1 libegl1 libegl-mesa0 >/dev/null 2>&1; then
  echo "[install_system] Vulkan loader, Mesa lavapipe $(mesa_version) and EGL already installed"
  exit 0
fi

codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
src=/etc/apt/sources.list.d/debian.sources
if [ "$codename" = "bookworm" ]; then
  # Add bookworm-backports to the existing Suites: line of the first stanza (same mirror as the machine uses).
  if [ -f "$src" ] && ! grep -q "bookworm-backports" "$src"; then
    echo "[install_system] adding bookworm-backports to $src"
    $SUDO sed -i '0,/^Suites: bookworm bookworm-updates$/s//Suites: bookworm bookworm-updates bookworm-backports/' "$src"
    grep -q "bookworm-backports" "$src" || {
      echo "[install_system] could not find the 'Suites: bookworm bookworm-updates' line in $src; add bookworm-backports to it by hand" >&2
      exit 1
    }
  fi
  $SUDO apt-get update -q
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q -t bookworm-backports $packages
else
  $SUDO apt-get update -q
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q $packages
fi
if ! dpkg --compare-versions "$(mesa_version)" ge "$MESA_MIN"; then
  echo "[install_system] Mesa $(mesa_version) is older than $MESA_MIN, which ManiSkill3 (SAPIEN) needs for CPU" \
    "simulation without a GPU. Supported: Debian 12 (from bookworm-backports), Debian 13, Ubuntu >= 25.04; on Ubuntu" \
    "22.04/24.04 install a newer Mesa (e.g. the kisak-mesa PPA) or use a machine with an NVIDIA driver." >&2
  exit 1
fi
echo "[install_system] done: mesa-vulkan-drivers $(mesa_version)"
