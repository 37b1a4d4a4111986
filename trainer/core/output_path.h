// Paths a run will write, checked before it starts working: a run that trained for a day must
// not find at its first save that checkpoint.dir is a file, on a read-only mount, or on a full
// disk.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tetra {

// That `path` (named in messages as `what`: a config key such as "checkpoint.dir", or an option
// such as "--dump-dir") is, or can be created as, a directory this process can write into, on a
// filesystem with at least `bytes_needed` bytes free (0: not checked). Creates nothing.
// InputError naming `what`, the path and the reason otherwise: a NUL in the path, an existing
// file that is not a directory (or a parent that is not one), no write permission or a read-only
// filesystem, too little free space.
void check_output_dir(const std::string& what, const std::string& path, uint64_t bytes_needed = 0);

// That the file `path` (named in messages as `what`, e.g. "--out") can be written: a file name (not
// a directory, nor a path ending in '/'), in an existing directory this process can write into;
// and, unless `force`, that it does not exist yet ("the file exists (pass --force to replace
// it)"; a symbolic link, even a dangling one, counts as existing); and, even with `force`, that it
// is none of `inputs` (the files the command reads: replacing one would destroy what it reads).
// Creates nothing. InputError naming `what` and the path otherwise.
void check_output_file(const std::string& what, const std::string& path, bool force,
                       const std::vector<std::string>& inputs = {});

}  // namespace tetra
