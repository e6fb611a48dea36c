#!/bin/sh
# Runs `episerve ARGS`. The umask makes a unix socket the daemon creates srwxrwx---: usable
# by the daemon's user and group (give training processes that group), by no one else.
umask 0007
exec episerve "$@"
