#!/usr/bin/env bash
# Install redis-server (Debian package) when missing; the tests start and stop their own
# server on 127.0.0.1.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" != 0 ]; then
  echo "redis-server is missing; install it (Debian: apt-get install redis-server)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq redis-server >/dev/null
# The package may start a system service; the tests use their own server.
(service redis-server stop || true) >/dev/null 2>&1
