#!/usr/bin/env bash
# A throwaway PostgreSQL server for the tests (and for trying `slipstream tune --storage postgresql://...`).
#
#   bash scripts/postgres.sh ensure           server binaries present? if not and root: apt-get install postgresql
#   bash scripts/postgres.sh start DIR PORT   new cluster in DIR on 127.0.0.1:PORT; prints its URL last
#   bash scripts/postgres.sh stop DIR         stop that cluster (pg_ctl stop: only the server started in DIR)
#
# The cluster listens on 127.0.0.1 only (and a unix socket in DIR), trusts loopback connections, and
# has superuser `slipstream` and database `optuna`: postgresql://slipstream@127.0.0.1:PORT/optuna.
# It is tuned for tests, not for keeping data (fsync off). PostgreSQL refuses to run as root: as root
# the server runs as the `postgres` system user (or `slipstream-pg`, made here if neither exists),
# and DIR is handed to that user, so DIR's parent folders must be traversable by it (/tmp is).
# Exit status 3 from `start`: no server binaries (the line printed says how to get them).
set -euo pipefail

DB_USER=slipstream
DB_NAME=optuna

die() {
	echo "postgres.sh: $*" >&2
	exit 1
}

bindir() {
	# Debian keeps the server binaries off PATH, one folder per major version: take the newest.
	local d
	if [[ -n "${PG_BIN:-}" && -x "$PG_BIN/initdb" ]]; then
		echo "$PG_BIN"
		return 0
	fi
	d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | while read -r x; do
		[[ -x "$x/initdb" && -x "$x/pg_ctl" ]] && echo "$x"
	done | tail -n 1)
	if [[ -z "$d" ]] && command -v initdb >/dev/null && command -v pg_ctl >/dev/null; then
		d=$(dirname "$(command -v initdb)")
	fi
	[[ -n "$d" ]] && echo "$d"
}

hint() {
	echo "PostgreSQL server binaries (initdb, pg_ctl) not found; install them: sudo apt-get install -y postgresql (or make test as root)"
}

cmd_ensure() {
	local d
	if d=$(bindir); then
		echo "postgresql server binaries: $d"
		return 0
	fi
	if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
		hint # the PostgreSQL tests skip with this reason
		return 0
	fi
	echo "installing postgresql (apt-get)"
	export DEBIAN_FRONTEND=noninteractive
	local apt=(apt-get install -y -q --no-install-recommends postgresql)
	if ! "${apt[@]}" >/tmp/slipstream-apt.log 2>&1; then
		apt-get update -q >>/tmp/slipstream-apt.log 2>&1 || true
		"${apt[@]}" >>/tmp/slipstream-apt.log 2>&1 || true
	fi
	if d=$(bindir); then
		echo "postgresql server binaries: $d"
	else
		echo "apt-get install postgresql failed (log: /tmp/slipstream-apt.log); the PostgreSQL tests will skip"
	fi
}

server_user() {
	# The system user the server runs as when we are root.
	if id -u postgres >/dev/null 2>&1; then
		echo postgres
	else
		id -u slipstream-pg >/dev/null 2>&1 ||
			useradd --system --no-create-home --shell /usr/sbin/nologin slipstream-pg >/dev/null 2>&1 ||
			die "cannot create user slipstream-pg to run PostgreSQL as (it refuses root)"
		echo slipstream-pg
	fi
}

# as USER CMD...: run CMD as USER when we are root (USER empty: as ourselves).
as() {
	local user=$1
	shift
	if [[ -z "$user" ]]; then
		"$@"
	elif command -v runuser >/dev/null; then
		runuser -u "$user" -- "$@"
	else
		su -s /bin/sh "$user" -c "$(printf '%q ' "$@")"
	fi
}

cmd_start() {
	[[ $# -eq 2 ]] || die "usage: postgres.sh start DIR PORT"
	local dir port bin user=""
	mkdir -p "$1"
	dir=$(cd "$1" && pwd)
	port=$2
	[[ "$port" =~ ^[0-9]+$ ]] || die "PORT must be a number, got $port"
	if ! bin=$(bindir); then
		hint
		exit 3
	fi
	[[ -e "$dir/data" ]] && die "$dir/data exists already (stop and remove the old cluster first)"
	if [[ $(id -u) -eq 0 ]]; then
		user=$(server_user)
		chown "$user" "$dir"
		as "$user" test -w "$dir" ||
			die "user $user cannot write $dir: its parent folders must be traversable (use a folder under /tmp)"
	fi
	cd "$dir" # initdb and the server as another user may not read our working folder
	as "$user" "$bin/initdb" -D "$dir/data" -U "$DB_USER" --auth=trust --no-locale -E UTF8 --no-sync \
		>"$dir/initdb.log" 2>&1 || {
		tail -n 20 "$dir/initdb.log" >&2
		die "initdb failed"
	}
	cat >>"$dir/data/postgresql.conf" <<CONF
# slipstream: a throwaway test cluster
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = '$dir'
fsync = off
synchronous_commit = off
full_page_writes = off
shared_buffers = 32MB
max_connections = 100
CONF
	# trust on loopback and the socket only: initdb's pg_hba.conf lists nothing else
	as "$user" "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 start >/dev/null || {
		tail -n 20 "$dir/server.log" >&2
		die "pg_ctl start failed (port $port taken?)"
	}
	as "$user" "$bin/createdb" -h 127.0.0.1 -p "$port" -U "$DB_USER" "$DB_NAME" ||
		die "createdb $DB_NAME failed"
	echo "postgresql://$DB_USER@127.0.0.1:$port/$DB_NAME"
}

cmd_stop() {
	[[ $# -eq 1 ]] || die "usage: postgres.sh stop DIR"
	local dir=$1 bin user=""
	[[ -f "$dir/data/postmaster.pid" ]] || return 0 # not running
	bin=$(bindir) || die "no pg_ctl to stop $dir with"
	[[ $(id -u) -eq 0 ]] && user=$(stat -c %U "$dir/data")
	cd "$dir"
	as "$user" "$bin/pg_ctl" -D "$dir/data" -m fast -w -t 60 stop >/dev/null
}

case "${1:-}" in
ensure) cmd_ensure ;;
start) shift && cmd_start "$@" ;;
stop) shift && cmd_stop "$@" ;;
*) die "usage: postgres.sh ensure | start DIR PORT | stop DIR" ;;
esac
