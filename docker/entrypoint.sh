#!/bin/sh
# Container entrypoint: refuse to start without access keys, then `exec scriptserve serve`.
#
#   docker run ... scriptserve:cpu [serve options]   -> scriptserve serve [serve options]
#   docker run ... scriptserve:cpu scriptserve ...   -> runs that command as given
#
# The server listens beyond loopback inside the container, so both APIs need their keys: from
# SCRIPTSERVE_{MANAGEMENT,INFERENCE}_KEY, or from the file that
# SCRIPTSERVE_{MANAGEMENT,INFERENCE}_KEY_FILE names (a mounted secret).
# SCRIPTSERVE_INSECURE_NO_AUTH=true turns every check off, for a deployment behind an
# authenticating proxy only. Exit status 78 (EX_CONFIG) when a key is missing.
set -eu

if [ "$#" -gt 0 ] && [ "${1#-}" = "$1" ]; then
    exec "$@"
fi

insecure=$(printf '%s' "${SCRIPTSERVE_INSECURE_NO_AUTH:-false}" | tr '[:upper:]' '[:lower:]')

# key_given NAME: a non-empty SCRIPTSERVE_<NAME>_KEY, or a readable non-empty file named by
# SCRIPTSERVE_<NAME>_KEY_FILE. Prints the problem and returns 1 otherwise.
key_given() {
    eval "value=\${SCRIPTSERVE_${1}_KEY:-}"
    eval "file=\${SCRIPTSERVE_${1}_KEY_FILE:-}"
    if [ -n "$file" ]; then
        if [ ! -r "$file" ]; then
            echo "scriptserve: SCRIPTSERVE_${1}_KEY_FILE=$file is not a readable file" >&2
            return 1
        fi
        if [ -z "$(tr -d '[:space:]' < "$file")" ]; then
            echo "scriptserve: SCRIPTSERVE_${1}_KEY_FILE=$file is empty" >&2
            return 1
        fi
        return 0
    fi
    if [ -n "$value" ]; then
        return 0
    fi
    api=$(printf '%s' "$1" | tr '[:upper:]' '[:lower:]')
    echo "scriptserve: no $api key: set SCRIPTSERVE_${1}_KEY or mount a secret and set" \
        "SCRIPTSERVE_${1}_KEY_FILE to its path" >&2
    return 1
}

case "$insecure" in
    true | 1 | yes | on)
        echo "scriptserve: SCRIPTSERVE_INSECURE_NO_AUTH is set: every API is open to anyone" \
            "who can reach its port" >&2
        ;;
    *)
        missing=0
        key_given MANAGEMENT || missing=1
        key_given INFERENCE || missing=1
        if [ "$missing" -ne 0 ]; then
            echo "scriptserve: refusing to start without access keys (or set" \
                "SCRIPTSERVE_INSECURE_NO_AUTH=true to run with no auth at all)" >&2
            exit 78
        fi
        ;;
esac

exec scriptserve serve "$@"
