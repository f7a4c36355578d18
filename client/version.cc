#include "flatshard/version.h"

namespace flatshard {
namespace client {

const char* LibraryVersion() { return FLATSHARD_VERSION_STRING; }

}  // namespace client
}  // namespace flatshard
