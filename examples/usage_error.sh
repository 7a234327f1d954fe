#!/bin/sh
# usage_error.sh MESSAGE PROGRAM [ARGS...]: passes when PROGRAM exits with status 2 (the examples'
# usage error, common/cli.hpp) and its output contains MESSAGE.
message=$1
shift
output=$("$@" 2>&1)
status=$?
if [ "$status" -ne 2 ]; then
  echo "expected exit status 2, got $status; output:"
  echo "$output"
  exit 1
fi
case $output in
  *"$message"*) exit 0 ;;
esac
echo "exit status 2, but the output lacks '$message':"
echo "$output"
exit 1
