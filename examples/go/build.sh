#!/usr/bin/env bash
# Build the Go example client as OUT_DIR/specdec-client: generate the stubs from protos/specdec/v1/*.proto with
# protoc, then `go build`, offline, against Debian bookworm's Go packages (grpc-go 1.33, protobuf-go 1.28):
#
#   apt-get install golang-go golang-google-grpc-dev golang-github-golang-protobuf-1-5-dev \
#       golang-google-protobuf-dev protoc-gen-go protoc-gen-go-grpc protobuf-compiler
#   bash examples/go/build.sh /tmp/specdec-go && /tmp/specdec-go/specdec-client -selector ... -executor ...
#
# GOPATH mode: Debian installs Go sources under /usr/share/gocode (GOPATH_DEPS overrides), not as modules.
set -euo pipefail
out=$(realpath -m "${1:?usage: build.sh OUT_DIR}")
here=$(cd "$(dirname "$0")" && pwd)
protos=$(realpath "$here/../../protos")
package=specdecclient  # the import path of this program; its stubs are $package/specdecv1
gopath=$out/gopath

rm -rf "$gopath/src/$package"
mkdir -p "$gopath/src/$package"
# The protos name no go_package; map each file to the stubs' import path instead.
maps=""
for proto in common selector executor; do
  maps+="${maps:+,}Mspecdec/v1/$proto.proto=$package/specdecv1"
done
protoc -I "$protos" --go_out="$gopath/src" --go_opt="$maps" --go-grpc_out="$gopath/src" --go-grpc_opt="$maps" \
  "$protos"/specdec/v1/{common,selector,executor}.proto
cp "$here/main.go" "$gopath/src/$package/"
(cd "$gopath/src/$package" &&
  GO111MODULE=off GOFLAGS= GOPROXY=off GOPATH="$gopath:${GOPATH_DEPS:-/usr/share/gocode}" \
    go build -o "$out/specdec-client" .)
echo "$out/specdec-client"
