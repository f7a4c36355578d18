#!/usr/bin/env bash
# Makes the files of the Secret flatshardd-tls that base/daemonset.yaml mounts at
# /etc/flatshard/tls (README.md here, "TLS Secret"), with openssl:
#   ca.crt, ca.key          a CA for flatshard only (keep ca.key off the cluster);
#   tls.crt, tls.key        the daemons' certificate, for serving (7450, 7451) and for the
#                           channels to peer daemons, which check each other's address: every
#                           node address is in its subjectAltName;
#   client.crt, client.key  an operator's client certificate: flatshardctl status
#                           --address NODE_IP:7450 --tls-ca ca.crt --tls-cert client.crt
#                           --tls-key client.key
# then prints the kubectl command that creates the Secret from ca.crt, tls.crt and tls.key.
#
# Usage: make-tls-secret.sh OUT_DIR [NODE_ADDRESS...]
#   NODE_ADDRESS: an IP or a DNS name the daemons' peers dial (--peer_address is the pod IP,
#   i.e. the node's IP under hostNetwork). None given: every node's InternalIP from kubectl.
#   A node added later needs a new tls.crt (rerun with the same OUT_DIR: the CA is kept).
# Environment: FLATSHARD_TLS_DAYS (validity, default 365).
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
if [ "${1:-}" = "--help" ]; then usage; exit 0; fi
if [ $# -lt 1 ]; then usage >&2; exit 2; fi
out=$1
shift
days=${FLATSHARD_TLS_DAYS:-365}
addresses=("$@")
if [ ${#addresses[@]} -eq 0 ]; then
  read -r -a addresses < <(kubectl get nodes \
    -o jsonpath='{.items[*].status.addresses[?(@.type=="InternalIP")].address}')
  [ ${#addresses[@]} -gt 0 ] || { echo "make-tls-secret.sh: kubectl listed no node InternalIP" >&2; exit 1; }
fi

san=""
for a in "${addresses[@]}"; do
  if [[ $a =~ ^[0-9.]+$ || $a == *:* ]]; then san+="IP:$a,"; else san+="DNS:$a,"; fi
done
san=${san%,}

mkdir -p "$out"
cd "$out"
umask 077
key=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)
if [ ! -s ca.key ] || [ ! -s ca.crt ]; then
  openssl req -x509 "${key[@]}" -keyout ca.key -out ca.crt -days "$days" \
    -subj /CN=flatshard-ca -addext basicConstraints=critical,CA:TRUE \
    -addext keyUsage=critical,keyCertSign,cRLSign 2>/dev/null
fi
# sign NAME SUBJECT EXTENSIONS
sign() {
  openssl req -new "${key[@]}" -keyout "$1.key" -out "$1.csr" -subj "$2" 2>/dev/null
  printf '%s\n' "$3" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -out "$1.crt" \
    -days "$days" -extfile "$1.ext" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}
sign tls /CN=flatshardd "subjectAltName=$san
extendedKeyUsage=serverAuth,clientAuth
keyUsage=critical,digitalSignature"
sign client /CN=flatshard-operator "extendedKeyUsage=clientAuth
keyUsage=critical,digitalSignature"
chmod 0644 ca.crt tls.crt client.crt

echo "wrote $out/{ca,tls,client}.{crt,key} (tls.crt for: $san); create the Secret with:"
echo "  kubectl -n flatshard create secret generic flatshardd-tls" \
     "--from-file=ca.crt=$out/ca.crt --from-file=tls.crt=$out/tls.crt --from-file=tls.key=$out/tls.key"
