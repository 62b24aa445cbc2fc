#!/usr/bin/env bash
# System packages: the Vulkan loader and a Vulkan driver, which ManiSkill3 (SAPIEN) needs even for state-only
# simulation. On a CPU-only Debian bookworm machine the driver is Mesa's lavapipe (software Vulkan), which must
# be >= 24.3, so it comes from bookworm-backports. A machine with an NVIDIA driver already has its own Vulkan
# driver and needs only the loader. Safe to run twice; prints what it does.
set -euo pipefail

SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi

have_lavapipe() {
  ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1 || return 1
  local v
  v=$(dpkg-query -W -f='${Version}' mesa-vulkan-drivers 2>/dev/null || echo 0)
  dpkg --compare-versions "$v" ge 24.3
}

if have_lavapipe && ldconfig -p | grep -q libvulkan.so.1; then
  echo "[install_system] Vulkan loader and Mesa lavapipe >= 24.3 already installed"
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  echo "[install_system] no apt-get: install a Vulkan loader and driver (Mesa >= 24.3 lavapipe, or your GPU's) by hand" >&2
  exit 1
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
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q -t bookworm-backports mesa-vulkan-drivers libvulkan1
else
  # Newer Debian/Ubuntu releases ship Mesa >= 24.3 in their main archive.
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q mesa-vulkan-drivers libvulkan1
fi
echo "[install_system] done: $(dpkg-query -W -f='mesa-vulkan-drivers ${Version}' mesa-vulkan-drivers)"
